"""Merge numba kernel disk caches written by separate processes (each with its own NUMBA_CACHE_DIR)
into one directory, so that warm-ups can compile side by side without sharing an index: numba
numbers a function's cache entries from its index file (<function>.nbi), read just before each
write, so two processes adding different variants of one kernel at once could leave an index entry
pointing at the other's code. Here every index is read, its entries' data files (<function>.<n>.nbc)
copied under fresh numbers, and one index written per function (the first copy of a key wins).

    quant9_cache_merge.py OUT_DIR IN_DIR...        (files keep their paths relative to IN_DIR)"""
import os
import pickle
import shutil
import sys


def read_index(path: str):
    """(version, stamp, {key: data file name}) of an index file."""
    with open(path, "rb") as f:
        version = pickle.load(f)
        stamp, overloads = pickle.loads(f.read())
    return version, stamp, overloads


def write_index(path: str, version, stamp, overloads: dict) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(version, f, protocol=-1)
        f.write(pickle.dumps((stamp, overloads), protocol=-1))
    os.replace(path + ".tmp", path)


def merge(out_dir: str, in_dirs: list[str]) -> tuple[int, int]:
    """(indexes written, entries in them)."""
    merged = {}  # relative index path -> (version, stamp, {key: (source dir, data name)})
    for root in in_dirs:
        for folder, _, files in os.walk(root):
            for name in files:
                if not name.endswith(".nbi"):
                    continue
                rel = os.path.relpath(os.path.join(folder, name), root)
                try:
                    version, stamp, overloads = read_index(os.path.join(folder, name))
                except Exception as e:  # noqa: BLE001 - a torn index is skipped, its kernels compile again
                    print(f"skipped {rel}: {type(e).__name__}: {e}")
                    continue
                have = merged.setdefault(rel, (version, stamp, {}))
                if (have[0], have[1]) != (version, stamp):
                    print(f"skipped {rel} of {root}: another numba version or source stamp")
                    continue
                for key, data in overloads.items():
                    have[2].setdefault(key, (folder, data))
    entries = 0
    for rel, (version, stamp, overloads) in merged.items():
        target = os.path.join(out_dir, os.path.dirname(rel))
        os.makedirs(target, exist_ok=True)
        base = os.path.basename(rel)[:-len(".nbi")]
        index = {}
        for number, (key, (folder, data)) in enumerate(overloads.items(), 1):
            if os.path.exists(os.path.join(folder, data)):
                name = f"{base}.{number}.nbc"
                shutil.copyfile(os.path.join(folder, data), os.path.join(target, name))
                index[key] = name
        write_index(os.path.join(out_dir, rel), version, stamp, index)
        entries += len(index)
    return len(merged), entries


if __name__ == "__main__":
    indexes, entries = merge(sys.argv[1], sys.argv[2:])
    print(f"merged {entries} cached kernels of {indexes} functions into {sys.argv[1]}")
