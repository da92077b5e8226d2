"""The machine's own jitter (issue 20, thirty-fifth session): on the thirty-fifth session's H100 a decode step that
read 108 MiB of missed experts in place took 21.6 ms where its like took 3-5, with no image and no other process
at work. Are those outliers the link's, the GPU's or the host's? Each part alone, no moebus process running:

- mapped reads: a kernel reads N MiB of pinned, mapped host memory (how decode reads its misses), timed by events;
- copies: the same MiB copied host to device by the copy engine, timed by events;
- a tiny kernel launched and waited for, timed on the host (launch, completion, wake-up);
- the host: a Python loop reading the clock, its largest step (descheduling).

Each prints the median, p99, p99.9, the largest and how many exceed 3x and 5x the median.
    python3 tools/device/jitter37.py [--mib 108] [--reps 2000]
Other modes, one at a time: ``--api-s S`` a step's host side for S seconds beside a thread that wakes every 3 ms;
``--mapped-s S [--total-mib M]`` mapped reads for S seconds (windows walking an M MiB buffer), the slow ones with
their wall-clock time; ``--pin-mib M`` another process's pinning of M MiB, its windows' wall-clock times
(tools/device/pin39.sh runs one beside the others)."""
from __future__ import annotations

import argparse
import time

import numpy as np

from moebus.cuda.kernels.compat import cuda  # numpy 2.5 beside numba-cuda: compat mends it first


@cuda.jit
def read_all(src, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    acc = 0
    for j in range(i, src.size, stride):
        acc += src[j]
    out[i] = acc


@cuda.jit
def read_window(src, start, count, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    acc = 0
    for j in range(start + i, start + count, stride):
        acc += src[j]
    out[i] = acc


@cuda.jit
def tiny(out):
    out[0] += 1


def report(name: str, ms) -> None:
    ms = np.asarray(ms, np.float64)
    med = float(np.median(ms))
    p99, p999 = np.percentile(ms, [99, 99.9])
    print(f"{name}: n {len(ms)}, median {med:.3f} ms, p99 {p99:.3f}, p99.9 {p999:.3f}, max {ms.max():.3f} "
          f"({ms.max() / med:.1f}x), >3x {int((ms > 3 * med).sum())}, >5x {int((ms > 5 * med).sum())}", flush=True)


def timed_events(stream, reps: int, work) -> list[float]:
    out = []
    for _ in range(reps):
        a, b = cuda.event(), cuda.event()
        a.record(stream)
        work()
        b.record(stream)
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def steal_jiffies() -> int:
    """The host's stolen time so far (the hypervisor ran someone else on these CPUs), summed over CPUs."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def api_loop(seconds: float, mib: float) -> None:
    """A decode step's host side without moebus: a tiny kernel on one stream, a copy of ``mib`` MiB from
    pinned memory on another, an event recorded and queried, the kernel's stream waited for; each
    iteration's host wall, and a second thread that wakes every 3 ms (how late it wakes: the GIL held, or
    the process not running)."""
    import threading

    compute, copies = cuda.stream(), cuda.stream()
    one = cuda.device_array(1, np.int64)
    n = int(mib * 2**20) // 8
    src, dst = cuda.pinned_array(n, np.int64), cuda.device_array(n, np.int64)
    tiny[1, 1, compute](one)
    compute.synchronize()
    late, stop = [], threading.Event()

    def sampler():
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.003)
            late.append((time.perf_counter() - t) * 1e3 - 3.0)

    thread = threading.Thread(target=sampler, daemon=True)
    steal0, switches0 = steal_jiffies(), open("/proc/self/status").read()
    thread.start()
    walls, slow, end = [], [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        tiny[1, 1, compute](one)
        dst.copy_to_device(src, stream=copies)
        event = cuda.event()
        event.record(copies)
        getattr(event, "query", bool)()  # (the simulator has none)
        compute.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
        if walls[-1] > SLOW_MS:
            slow.append((time.time(), walls[-1]))
    listed = " ".join(f"{w:.3f}@{t:.3f}" for t, w in slow[:60])
    print(f"iterations over {SLOW_MS:.0f} ms (ms@wall clock): {listed}")
    stop.set()
    thread.join()
    report(f"host side of a step ({mib:.0f} MiB copy beside a tiny kernel) over {seconds:.0f} s", walls)
    late = np.asarray(late)
    print(f"a thread waking every 3 ms: {len(late)} wakes, late by median {np.median(late):.3f} ms, "
          f"p99.9 {np.percentile(late, 99.9):.3f}, max {late.max():.3f}; > 2 ms {int((late > 2).sum())}, "
          f"> 5 ms {int((late > 5).sum())}; the host's stolen time meanwhile {steal_jiffies() - steal0} jiffies")
    ctxt = [line for line in open("/proc/self/status").read().splitlines() if "ctxt_switches" in line]
    was = [line for line in switches0.splitlines() if "ctxt_switches" in line]
    print("context switches (before -> after):", "; ".join(f"{a.split()[0]} {a.split()[1]} -> {b.split()[1]}"
                                                           for a, b in zip(was, ctxt)))


def mapped_loop(seconds: float, mib: float, total_mib: float = 0.0) -> None:
    """Mapped reads of ``mib`` MiB (as decode reads its misses) for ``seconds``: the reads over twice the median
    listed with their wall-clock time (to set beside another process's pinning windows). ``total_mib``: the
    mapped buffer's size (default ``mib``), each read a window of it after the last one's, as misses fall over
    a host store of GiBs."""
    n = int(mib * 2**20) // 8
    total = max(n, int(total_mib * 2**20) // 8)
    stream = cuda.stream()
    mapped = cuda.mapped_array(total, np.int64)
    mapped[:] = 1
    blocks, threads = getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", 1) * 8, 256
    out = cuda.device_array(blocks * threads, np.int64)
    read_window[blocks, threads, stream](mapped, 0, n, out)
    stream.synchronize()
    ms, at, end, start = [], [], time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        ms += timed_events(stream, 1, lambda: read_window[blocks, threads, stream](mapped, start, n, out))
        at.append(time.time())
        start = start + n if start + 2 * n <= total else 0
    report(f"mapped read {mib:.0f} MiB (of {total * 8 / 2**20:.0f}) over {seconds:.0f} s", ms)
    med = float(np.median(ms))
    listed = " ".join(f"{m:.2f}@{t:.3f}" for m, t in zip(ms, at) if m > 2 * med)
    print("reads over 2x the median (ms@wall clock):", listed[:3000])


SLOW_MS = 3.0  # an api_loop iteration over this is listed with its wall-clock time


def pinner(mib: float, count: int, every_s: float) -> None:
    """Another process's pinning (as a vision worker's start pins its streamed tower's weights): ``count``
    times, a pinned buffer of ``mib`` MiB allocated, filled and freed, ``every_s`` apart; each window's
    wall-clock start and end printed."""
    import gc

    cuda.pinned_array(1, np.uint8)  # the context, before the first window
    for _ in range(count):
        time.sleep(every_s)
        t = time.time()
        host = cuda.pinned_array(int(mib * 2**20), np.uint8)
        allocated = time.time()
        host[:] = 1
        filled = time.time()
        del host
        gc.collect()
        print(f"pinned {mib:.0f} MiB: {t:.3f} - {allocated:.3f} (allocated), filled at {filled:.3f}, freed at "
              f"{time.time():.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=108.0)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--host-s", type=float, default=5.0)
    ap.add_argument("--api-s", type=float, default=0.0, help="only the host-side loop, this many seconds")
    ap.add_argument("--mapped-s", type=float, default=0.0, help="only mapped reads, this many seconds")
    ap.add_argument("--total-mib", type=float, default=0.0, help="--mapped-s's buffer (default --mib)")
    ap.add_argument("--pin-mib", type=float, default=0.0, help="only pin this many MiB --pin-count times")
    ap.add_argument("--pin-count", type=int, default=5)
    ap.add_argument("--pin-every-s", type=float, default=2.0)
    args = ap.parse_args()
    if args.pin_mib > 0:
        pinner(args.pin_mib, args.pin_count, args.pin_every_s)
        return
    if args.mapped_s > 0:
        mapped_loop(args.mapped_s, args.mib, args.total_mib)
        return
    if args.api_s > 0:
        api_loop(args.api_s, args.mib)
        return
    n = int(args.mib * 2**20) // 8
    stream = cuda.stream()
    mapped = cuda.mapped_array(n, np.int64)
    mapped[:] = 1
    blocks, threads = getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", 1) * 8, 256
    out = cuda.device_array(blocks * threads, np.int64)
    read_all[blocks, threads, stream](mapped, out)
    stream.synchronize()
    ms = timed_events(stream, args.reps, lambda: read_all[blocks, threads, stream](mapped, out))
    report(f"mapped read {args.mib:.0f} MiB ({args.mib * 2**20 / 1e6 / np.median(ms):.1f} GB/s at the median)", ms)
    pinned = cuda.pinned_array(n, np.int64)
    pinned[:] = 1
    dev = cuda.device_array(n, np.int64)
    ms = timed_events(stream, args.reps // 2, lambda: dev.copy_to_device(pinned, stream=stream))
    report(f"copy H2D {args.mib:.0f} MiB ({args.mib * 2**20 / 1e6 / np.median(ms):.1f} GB/s at the median)", ms)
    one = cuda.device_array(1, np.int64)
    tiny[1, 1, stream](one)  # compiled and loaded before the timed loop
    stream.synchronize()
    walls = []
    for _ in range(args.reps * 2):
        t = time.perf_counter()
        tiny[1, 1, stream](one)
        stream.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    report("tiny kernel launched and waited for (host wall)", walls)
    reads, largest, over = 0, 0.0, [0, 0, 0]  # steps over 0.5, 2 and 5 ms
    last = time.perf_counter()
    end = last + args.host_s
    while last < end:
        now = time.perf_counter()
        step = (now - last) * 1e3
        reads += 1
        if step > 0.5:
            largest = max(largest, step)
            over[0] += 1
            over[1] += step > 2
            over[2] += step > 5
        last = now
    print(f"host clock loop over {args.host_s:.0f} s: {reads} reads, largest step over 0.5 ms {largest:.3f} ms, "
          f"> 0.5 ms {over[0]}, > 2 ms {over[1]}, > 5 ms {over[2]}")

if __name__ == "__main__":
    main()
