"""On a GPU: how fast the elastic expert cache hands VRAM back and takes it again, and whether
another process really gets the released memory.

1. An arena takes all free VRAM but ``--headroom-gib`` (segments of ``--segment-mib``).
2. Copy-in bandwidth: expert-sized blobs from pinned host memory into slots (the miss path).
3. A second process tries to cudaMalloc ``--release-gib``: it must fail while the cache is full.
4. ExpertCache.resize(release + headroom) releases ``--release-gib`` of segments (timed), the
   second process allocates them, then a bare resize regrows the cache (timed). Repeated; medians."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

SECOND_PROCESS = """
import sys
from numba import cuda
try:
    a = cuda.device_array(int(sys.argv[1]), dtype='uint8'); cuda.synchronize(); print('ok')
except Exception as e:
    print('fail', type(e).__name__)
"""


def _second_process_allocates(num_bytes: int) -> bool:
    out = subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(num_bytes)], capture_output=True, text=True)
    return out.stdout.strip() == "ok"


class _BlobStore:
    """Expert-sized blobs in pinned memory (a HostStore without a checkpoint): ``layers`` x
    ``num_experts`` keys, one blob each, so that every key the cache is asked for has its blob."""

    def __init__(self, blob_bytes: int, layers: int, num_experts: int):
        from numba import cuda

        self.blob_bytes = blob_bytes
        self.num_experts = num_experts
        self.blobs = cuda.pinned_array((layers * num_experts, blob_bytes // 2), dtype=np.uint16)
        self.blobs[:] = np.arange(self.blobs.shape[1], dtype=np.uint16)  # the values do not matter

    def key(self, layer, expert):
        return layer * self.num_experts + int(expert)

    def blob(self, key):
        return self.blobs[key]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench vram")
    p.add_argument("--segment-mib", type=int, default=64)
    p.add_argument("--release-gib", type=float, default=2.0)
    p.add_argument("--headroom-gib", type=float, default=1.0, help="left free: another process's context")
    p.add_argument("--blob-mib", type=float, default=9.0, help="one expert (Qwen3-30B-A3B: 9 MiB)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    from moebus.cuda.kernels import compat  # noqa: F401
    from moebus.cuda.memory.arena import plan_segments
    from moebus.cuda.memory.ledger import MIB
    from moebus.cuda.memory.vmm import StreamCopier, VmmArena, device_memory_info
    from moebus.workers.expert_cache import ExpertCache
    from numba import cuda

    free, total = device_memory_info()
    blob_bytes = int(args.blob_mib * MIB) // 4096 * 4096
    arena_bytes = (free - int(args.headroom_gib * 1024 * MIB)) // (2 * MIB) * (2 * MIB)
    arena = VmmArena(blob_bytes, np.uint16, plan_segments(arena_bytes, args.segment_mib * MIB))
    t = time.perf_counter()
    arena.grow()
    map_s = time.perf_counter() - t
    store = _BlobStore(blob_bytes, args.repeats, 64)  # a layer of 64 fresh experts per repeat

    class _Backend:
        stream = cuda.stream()

    cache = ExpertCache(store, arena, StreamCopier(arena, _Backend()), startup_reserve_mib=0.0, min_slots=8)
    copy_rates = []
    for rep in range(args.repeats):
        cuda.synchronize()
        t = time.perf_counter()
        cache.acquire(rep, range(64))  # 64 misses: their copies in
        cache.wait()
        cuda.synchronize()
        copy_rates.append(64 * blob_bytes / (time.perf_counter() - t) / 1e9)
        cache.release()
    release_bytes = int(args.release_gib * 1024 * MIB)
    before = _second_process_allocates(release_bytes)
    release_ms, regrow_ms, after = [], [], []
    # the headroom stays free throughout: it is the second process's own CUDA context
    reserve_mib = (args.release_gib + args.headroom_gib) * 1024
    for _ in range(args.repeats):
        t = time.perf_counter()
        report = cache.resize(reserve_mib)
        release_ms.append((time.perf_counter() - t) * 1e3)
        after.append(_second_process_allocates(release_bytes))
        t = time.perf_counter()
        cache.resize(None)
        regrow_ms.append((time.perf_counter() - t) * 1e3)
    results = {
        "gpu_total_gib": round(total / 2 ** 30, 1), "arena_gib": round(arena.mapped_bytes / 2 ** 30, 2),
        "segment_mib": args.segment_mib, "slots": arena.num_slots, "map_all_s": round(map_s, 3),
        "copy_in_GBps_median": round(statistics.median(copy_rates), 1),
        "release_gib": args.release_gib, "release_ms_median": round(statistics.median(release_ms), 2),
        "regrow_ms_median": round(statistics.median(regrow_ms), 2),
        "second_process_alloc_before_release": before, "second_process_alloc_after_release": all(after),
        "free_mib_after_release": report["free_mib"],
    }
    for k, v in results.items():
        print(f"{k:<38} {v}")
    print(json.dumps(results))
    arena.close()
    return 0
