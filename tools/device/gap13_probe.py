"""Issue 20's start phase (thirteenth session): what slows a decode-like step on one GPU while a
second process creates its CUDA context, uploads weights and launches its first kernels (as the
vision worker's start does beside the language worker: its decode steps went from ~5 to 10-13 ms).

This process loops a step made of the parts a decode step leans on, each timed by CUDA events:
  mapped   a kernel reading pinned host memory in place over PCIe (the cache's misses: ~185 MiB a step)
  compute  a kernel on device memory only (the SMs)
  copy     a host-to-device copy of pinned memory on a second stream (the copy engine: admissions)
and the step's host time (launches and the sync). After ``--lead-s`` it starts a second Python
process that imports numba, creates its context, allocates and uploads ``--upload-mib`` from
pageable memory, launches a kernel and exits, printing when each phase ended. It then prints, per
phase of that process, each part's median and max (ms): a host stall shows as host time above the
parts' sum with the parts unchanged, the copy engine as ``copy`` slower, PCIe as ``mapped`` slower,
the SMs (time-slicing between the two contexts) as ``compute`` slower.

    python3 tools/device/gap13_probe.py [--seconds 7] [--lead-s 1.5] [--mapped-mib 96] [--upload-mib 800]"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from numba import cuda

OTHER = r"""
import sys, time
import numpy as np
def say(what):
    print(f"{time.time():.6f} {what}", flush=True)
say("started")
from numba import cuda
say("imported")
cuda.current_context()
say("context")
host = np.ones(int(float(sys.argv[1]) * 2**20) // 4, np.float32)
device = cuda.device_array_like(host)
say("allocated")
device.copy_to_device(host)
cuda.synchronize()
say("uploaded")
@cuda.jit
def scale(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] *= 2.0
scale[(host.size + 255) // 256, 256](device)
cuda.synchronize()
say("kernel")
for _ in range(20):
    scale[(host.size + 255) // 256, 256](device)
cuda.synchronize()
say("kernels")
"""


@cuda.jit
def read_mapped(src, out):  # every thread sums a strided share of the mapped host array
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    total = 0.0
    while i < src.size:
        total += src[i]
        i += stride
    out[cuda.grid(1)] = total


@cuda.jit
def spin(x, rounds):  # device memory only
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        for _ in range(rounds):
            v = v * 1.0000001 + 0.5
        x[i] = v


class Timeless:
    """The simulator's stand-in for a timing event (its events take no arguments)."""

    def record(self, stream=None) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=7.0)
    p.add_argument("--lead-s", type=float, default=1.5)
    p.add_argument("--mapped-mib", type=int, default=96)
    p.add_argument("--copy-mib", type=int, default=32)
    p.add_argument("--upload-mib", type=float, default=800)
    p.add_argument("--rounds", type=int, default=400_000)  # ~0.8 ms of dependent FMAs a thread
    p.add_argument("--blocks", type=int, default=132 * 8)
    args = p.parse_args()
    mapped = cuda.mapped_array(args.mapped_mib * 2**20 // 4, np.float32)
    mapped[:] = 1.0
    blocks, threads = args.blocks, 256
    partial = cuda.device_array(blocks * threads, np.float32)
    work = cuda.to_device(np.ones(blocks * 256, np.float32))
    pinned = cuda.pinned_array(args.copy_mib * 2**20 // 4, np.float32)
    target = cuda.device_array_like(pinned)
    main_stream, copy_stream = cuda.stream(), cuda.stream()
    simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"  # (a dry run of this script on the cpu)
    events = [Timeless() if simulated else cuda.event(timing=True) for _ in range(5)]
    elapsed = (lambda a, b: 0.0) if simulated else cuda.event_elapsed_time

    def step():
        started = time.perf_counter()
        e0, e1, e2, c0, c1 = events
        e0.record(main_stream)
        read_mapped[blocks, threads, main_stream](mapped, partial)
        e1.record(main_stream)
        spin[(work.size + 255) // 256, 256, main_stream](work, args.rounds)
        e2.record(main_stream)
        c0.record(copy_stream)
        target.copy_to_device(pinned, stream=copy_stream)
        c1.record(copy_stream)
        main_stream.synchronize()
        copy_stream.synchronize()
        host = time.perf_counter() - started
        return 1e3 * host, elapsed(e0, e1), elapsed(e1, e2), elapsed(c0, c1)

    for _ in range(20):  # compiled and warm
        step()
    rows, other, marks = [], None, []
    began = time.time()
    while time.time() - began < args.seconds:
        if other is None and time.time() - began >= args.lead_s:
            other = subprocess.Popen([sys.executable, "-c", OTHER, str(args.upload_mib)], stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            marks.append((time.time(), "spawned"))
        at = time.time()
        rows.append((at, *step()))
    if other is not None:
        out, _ = other.communicate(timeout=60)
        for line in out.split("\n"):
            if line.strip():
                stamp, what = line.split(" ", 1)
                marks.append((float(stamp), what))
    marks.sort()
    print(f"probe: {len(rows)} steps of mapped read {args.mapped_mib} MiB + compute + copy {args.copy_mib} MiB "
          f"(second stream); the other process: {', '.join(f'{w} +{1e3 * (t - marks[0][0]):.0f} ms' for t, w in marks)}")
    bounds = [(began, "alone before")] + marks + [(time.time() + 1, "end")]
    print(f"  {'window (the other process between)':38s} {'steps':>5s}  {'host ms':>11s}  {'mapped ms':>11s}  "
          f"{'compute ms':>11s}  {'copy ms':>11s}   (median / max)")
    for (lo, name), (hi, then) in zip(bounds, bounds[1:]):
        inside = [r for r in rows if lo <= r[0] < hi]
        label = name if name == "alone before" else f"{name} -> {then}"
        if not inside:
            print(f"  {label:38s} {0:5d}")
            continue
        cells = "  ".join(f"{statistics.median(col):5.2f}/{max(col):5.2f}" for col in list(zip(*inside))[1:])
        print(f"  {label:38s} {len(inside):5d}  {cells}")


if __name__ == "__main__":
    main()
