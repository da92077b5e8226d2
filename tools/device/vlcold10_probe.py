"""What a vision worker's start pays after its fork, and whether the zygote's preloads are safe
(tools/device/vlcold10.sh). A parent that imports what the zygote imports (no CUDA context) forks
children that each time: the CUDA context, the cuda backend (stream, pools, cuBLAS handle), the
first numba kernel and its wait, and the libraries mapped since the fork; then (the last child) the
upload of a WEIGHT_MIB buffer pageable, pinned in chunks and registered read-only (vision_weight_pack.upload_bytes).
Children 1 and 2 fork before the zygote's preload_libraries(), child 3 after it (child 1 compiles
the fill kernel on a fresh cache; compare 2 with 3). Prints ``preload safe: True|False`` (a child
forked after the preloads could not use CUDA: the cycle then runs with MOEBUS_VISION_PRELOAD=0).

    vlcold10_probe.py [WEIGHT_MIB]"""
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("NUMBA_CACHE_DIR", "/tmp/vlcold10-probe-cache")


def child(label: str, weight_mib: int) -> int:
    from moebus.workers.vision_worker import first_kernel, loaded_libraries

    libraries = loaded_libraries()
    t0 = time.perf_counter()
    from numba import cuda

    cuda.current_context()
    t1 = time.perf_counter()
    from moebus.cuda.backends.cuda import CudaBackend

    backend = CudaBackend()
    t2 = time.perf_counter()
    first_kernel(backend)
    t3 = time.perf_counter()
    new = sorted(loaded_libraries() - libraries)
    print(f"{label}: context {1e3 * (t1 - t0):.1f} ms, backend (stream, pools, cuBLAS handle) {1e3 * (t2 - t1):.1f} ms, "
          f"first kernel {1e3 * (t3 - t2):.1f} ms; {len(new)} libraries since the fork: {' '.join(new)[:600]}", flush=True)
    if weight_mib:
        from moebus.workers.vision_weight_pack import upload_bytes

        from moebus.workers.vision_weight_pack import pack

        host = pack({"w": np.arange(weight_mib << 20, dtype=np.uint8)}).buffer  # page-aligned, as the zygote's
        for mode in ("pageable", "pinned", "register", "pageable", "pinned", "register"):
            start = time.perf_counter()
            device = upload_bytes(backend, host, mode=mode)
            seconds = time.perf_counter() - start
            same = bool(np.array_equal(device[: 1 << 20].copy_to_host(), host[: 1 << 20]))
            print(f"upload {weight_mib} MiB {mode}: {1e3 * seconds:.1f} ms ({weight_mib / 1024 / seconds:.1f} GiB/s), "
                  f"first MiB equal: {same}", flush=True)
            del device
    return 0


def fork_child(label: str, weight_mib: int = 0) -> bool:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child(label, weight_mib)
        except BaseException as e:  # noqa: BLE001
            print(f"{label} failed: {type(e).__name__}: {e}", flush=True)
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def main() -> None:
    weight_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 800
    start = time.perf_counter()
    import moebus.cuda.backends.cuda  # noqa: F401 - as the zygote
    from moebus.cuda.kernels.compat import load_numba_target
    from moebus.workers.vision_zygote import _cuda_initialised, preload_libraries

    load_numba_target()
    print(f"parent imports and numba target: {time.perf_counter() - start:.2f} s", flush=True)
    fork_child("child 1 (no preload, fresh kernel cache)")
    fork_child("child 2 (no preload)")
    seconds = preload_libraries()
    print("parent preloaded:", {k: f"{1e3 * v:.1f} ms" for k, v in seconds.items()}, "numba CUDA initialised:",
          _cuda_initialised(), flush=True)
    ok = fork_child("child 3 (preloaded)", weight_mib)
    print(f"preload safe: {ok}", flush=True)


if __name__ == "__main__":
    main()
