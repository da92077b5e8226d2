"""Kernel benchmark at Qwen3-30B-A3B shapes: every op's accuracy against its numpy reference (NMSE
= |out - ref|^2 / |ref|^2, refs on the host) and its median GPU time over repeated launches, with
achieved bandwidth for the ops that stream weights or the KV cache.

    python -m moebus.bench.kernels            # on the GPU
    python -m moebus.bench.kernels --tiny     # every shape shrunk: a smoke run (simulator too)

Written to survive one unattended run: each case is isolated (an error is printed and the run goes
on), output is flushed line by line, and a deadline skips what is left rather than overrun."""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR, cuda, uint32, kernel  # compat first: numpy shims before numba compiles

QWEN3_30B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, inter=768, vocab=151936,
                 decode=(1, 8), prefill=512, context=1024)
# tiny still crosses every path: a second token chunk (prefill > 8), a second attention tile (> 32)
TINY = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, experts=8, top_k=2, inter=16, vocab=100,
            decode=(2,), prefill=9, context=34)


@dataclass
class Result:
    op: str
    shape: str
    nmse: float | None = None
    gpu_us: float | None = None
    host_us: float | None = None
    gb_per_s: float | None = None
    note: str = ""


@kernel
def _spin(rounds):
    # keeps the GPU busy while the host enqueues the timed launches, so event times are GPU times
    for _ in range(rounds):
        cuda.nanosleep(uint32(1000))


def time_launches(run, reps: int, warmup: int, stream) -> tuple[float | None, float]:
    """(median GPU microseconds per call from events, mean host microseconds per call)."""
    for _ in range(warmup):
        run()
    stream.synchronize()
    begin = time.perf_counter()
    for _ in range(reps):
        run()
    stream.synchronize()
    host_us = (time.perf_counter() - begin) / reps * 1e6
    if SIMULATOR:
        return None, host_us
    events = [(cuda.event(), cuda.event()) for _ in range(reps)]
    # nanosleep(1000) sleeps up to ~1 us: plan 4x the host's enqueue time so the spin outlasts it
    _spin[1, 1, stream](int(reps * max(host_us, 50.0) * 4))
    for start, end in events:
        start.record(stream)
        run()
        end.record(stream)
    events[-1][1].synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events), host_us


def nmse(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.sum((actual - expected) ** 2) / max(float(np.sum(expected ** 2)), 1e-300))


def print_table(results: list[Result]) -> None:
    print("\n" + f"{'op':<22} {'shape':<34} {'nmse':>9} {'gpu us':>9} {'host us':>9} {'GB/s':>8}  note")
    for r in results:
        cells = [f"{r.nmse:9.1e}" if r.nmse is not None else f"{'-':>9}",
                 f"{r.gpu_us:9.1f}" if r.gpu_us is not None else f"{'-':>9}",
                 f"{r.host_us:9.1f}" if r.host_us is not None else f"{'-':>9}",
                 f"{r.gb_per_s:8.0f}" if r.gb_per_s is not None else f"{'-':>8}"]
        print(f"{r.op:<22} {r.shape:<34} {' '.join(cells)}  {r.note}")
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="moebus kernel benchmark (Qwen3-30B-A3B shapes)")
    parser.add_argument("--tiny", action="store_true", help="shrink every shape (smoke test, simulator)")
    parser.add_argument("--reps", type=int, default=None, help="timed launches per case (default 30; tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed launches first (default 3; tiny 1)")
    parser.add_argument("--only", default="", help="run the cases whose op name contains this")
    parser.add_argument("--deadline-s", type=float, default=480.0, help="skip the remaining cases after this")
    args = parser.parse_args(argv)
    from moebus.bench.kernel_cases import make_cases  # the cases import every kernel module

    shapes = TINY if args.tiny else QWEN3_30B
    reps = args.reps or (2 if args.tiny else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    _print_header(shapes)
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    results, started = [], time.perf_counter()
    try:
        for case in make_cases(shapes):
            if args.only not in case.op:
                continue
            if time.perf_counter() - started > args.deadline_s:
                results.append(Result(case.op, case.shape, note="skipped: deadline"))
                continue
            results.append(_run_case(case, rng, stream, reps, warmup))
            r = results[-1]
            print(f"  {r.op:<22} {r.shape:<34} nmse={r.nmse} gpu_us={r.gpu_us} host_us={r.host_us} {r.note}",
                  flush=True)
    finally:
        print_table(results)
    return 1 if any(r.note.startswith("ERROR") for r in results) else 0


def _run_case(case, rng, stream, reps: int, warmup: int) -> Result:
    result = Result(case.op, case.shape)
    try:
        run, check, nbytes = case.setup(rng, stream)
        run()
        stream.synchronize()
        result.nmse, result.note = check()
        result.gpu_us, result.host_us = time_launches(run, reps, warmup, stream)
        if nbytes and result.gpu_us:
            result.gb_per_s = nbytes / (result.gpu_us * 1e-6) / 1e9
        if case.flops and result.gpu_us:
            result.note = f"{case.flops / (result.gpu_us * 1e-6) / 1e12:.0f} TFLOP/s {result.note}".strip()
    except Exception as exc:  # keep going: one broken case must not cost the others
        result.note = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        traceback.print_exc(file=sys.stdout)
    finally:
        cuda.current_context().deallocations.clear() if not SIMULATOR else None
    return result


def _print_header(shapes: dict) -> None:
    import numba

    device = "simulator" if SIMULATOR else cuda.get_current_device().name
    device = device.decode() if isinstance(device, bytes) else device
    print(f"moebus kernel bench on {device}; numba {numba.__version__}, numpy {np.__version__}, "
          f"python {platform.python_version()}")
    print("shapes: " + ", ".join(f"{k}={v}" for k, v in shapes.items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
