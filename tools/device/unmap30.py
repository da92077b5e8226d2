"""Issue 20 on a GPU (thirtieth session): what a hand-back request's unmap costs beside decode work, and whether
it could leave the worker's loop. A VmmArena like the 8 x 128 LLaVA's cache (6,778 MiB, 9 MiB slots) in segments
of 2 or 18 MiB; 64 MiB (one hand-back request) shrunk off it and grown back, five times each:

- idle: the shrink alone (sync, one cuMemUnmap, a cuMemRelease a segment);
- beside: a ~2 ms kernel launched first (the step launched beside), the shrink waiting for an event before it;
- thread: the shrink on a helper thread while the main thread launches ~2 ms kernels back to back and times
  each launch call and each kernel's end (does the unmap hold the launches, or the kernels?).

Prints one row per case: the shrink's ms (median / max), and for `thread` the main thread's longest launch call and
longest kernel-to-kernel interval during the shrinks against those without any (the same loop alone).
    python3 tools/device/unmap30.py"""
from __future__ import annotations

import statistics
import threading
import time

import numpy as np

from moebus.cuda.kernels import compat  # noqa: F401 - numpy shims before numba.cuda
from moebus.cuda.memory import vmm
from moebus.cuda.memory.arena import plan_segments
from moebus.cuda.memory.ledger import MIB
from numba import cuda

SLOT = 9 * MIB
CACHE = 6778 * MIB
REQUEST = 64 * MIB


@cuda.jit
def spin(out, count):
    """One block per SM of dependent arithmetic, ``count`` rounds (calibrated to a decode step's ~2 ms)."""
    acc = 1.0 + cuda.threadIdx.x * 1e-6
    for _ in range(count):
        acc = acc * 0.9999999 + 1e-7
    if acc < 0.0:  # never: keeps the loop
        out[cuda.blockIdx.x] = 1


def kernel_ms(out, cycles, stream) -> float:
    t = time.perf_counter()
    spin[132, 128, stream](out, cycles)
    stream.synchronize()
    return 1e3 * (time.perf_counter() - t)


def shrink_ms(arena, count, after=None) -> float:
    t = time.perf_counter()
    arena.shrink(count, after=after)
    return 1e3 * (time.perf_counter() - t)


def case_idle(arena, count):
    times = []
    for _ in range(5):
        cuda.synchronize()
        times.append(shrink_ms(arena, count))
        arena.grow()
    return times


def case_beside(arena, count, out, cycles, stream):
    times = []
    for _ in range(5):
        cuda.synchronize()
        event = cuda.event()
        event.record(stream)
        spin[132, 128, stream](out, cycles)  # launched after the event: the shrink waits for the event only
        times.append(shrink_ms(arena, count, after=event))
        stream.synchronize()
        arena.grow()
    return times


def launch_loop(out, cycles, stream, seconds, record):
    """Launch ~2 ms kernels back to back for ``seconds``: each launch call's ms and each end-to-end interval."""
    end = time.perf_counter() + seconds
    last = time.perf_counter()
    while time.perf_counter() < end:
        t = time.perf_counter()
        spin[132, 128, stream](out, cycles)
        launched = time.perf_counter()
        stream.synchronize()
        now = time.perf_counter()
        record.append((1e3 * (launched - t), 1e3 * (now - last)))
        last = now


def case_thread(arena, count, out, cycles, stream):
    alone = []
    launch_loop(out, cycles, stream, 0.3, alone)
    beside, times = [], []
    def shrinker():
        cuda.current_context()  # numba makes the primary context current on this thread too
        idle = cuda.stream()
        for _ in range(5):
            time.sleep(0.02)
            done = cuda.event()  # the last work on the leaving segments: long done (no device-wide sync)
            done.record(idle)
            times.append(shrink_ms(arena, count, after=done))
            arena.grow()
    helper = threading.Thread(target=shrinker)
    helper.start()
    launch_loop(out, cycles, stream, 0.0, beside)  # (none: the first interval)
    while helper.is_alive():
        launch_loop(out, cycles, stream, 0.02, beside)
    helper.join()
    return times, alone, beside


def main() -> None:
    print(f"device: {cuda.get_current_device().name}")
    stream = cuda.stream()
    out = cuda.device_array(132, np.int32)
    cycles = 100_000
    kernel_ms(out, cycles, stream)  # compiled
    cycles = int(cycles * 2.0 / kernel_ms(out, cycles, stream))  # ~2 ms
    print(f"spin kernel: {statistics.median(kernel_ms(out, cycles, stream) for _ in range(5)):.2f} ms")
    for segment_mib in (2, 18):
        arena = vmm.VmmArena(SLOT, np.uint8, plan_segments(CACHE, segment_mib * MIB))
        arena.grow()
        count = -(-REQUEST // (segment_mib * MIB))
        what = f"{count} segments of {segment_mib} MiB"
        idle = case_idle(arena, count)
        print(f"{what:<24} idle:   shrink {statistics.median(idle):.2f} / {max(idle):.2f} ms (median / max of 5)")
        beside = case_beside(arena, count, out, cycles, stream)
        print(f"{what:<24} beside: shrink {statistics.median(beside):.2f} / {max(beside):.2f} ms (a ~2 ms kernel "
              "launched after the event it waits for)")
        times, alone, during = case_thread(arena, count, out, cycles, stream)
        if not during:  # the helper ended before the main thread launched anything
            during = [(0.0, 0.0)]
        print(f"{what:<24} thread: shrink {statistics.median(times):.2f} / {max(times):.2f} ms; the main thread's "
              f"launch call max {max(a for a, _ in alone):.2f} ms alone, {max(a for a, _ in during):.2f} beside the "
              f"shrinks; kernel-to-kernel max {max(b for _, b in alone[1:]):.2f} alone, "
              f"{max(b for _, b in during):.2f} beside (median {statistics.median(b for _, b in during):.2f}, "
              f"{len(during)} kernels)")
        arena.close()


if __name__ == "__main__":
    main()
