"""On the GPU (issue 19, branch prefill9): a prefill of TOKENS through a cache of FRACTION of the
experts, the copy modes side by side in one process on one load, then every expert resident in the
same process (the reference: logits bit for bit, and its time).

Modes (the expert cache's ``copy_fence`` and the copier's ``driver_copies``):
  all/numba    the merged tree before this branch: the copy stream waits for all the work so far, the
               policy's victims, numba's copy a blob
  all          the same, one cuMemcpyHtoDAsync a blob
  slot-policy  per-slot fences, the policy's victims sparing the last group's slots
  slot         per-slot fences, farthest-next-use victims (this branch's default)
Rounds of (mode: one settling run whose logits are kept, then REPEATS timed runs) x ROUNDS; then one
run per mode with a timeline (per layer: host ms of the acquire, GPU ms of the compute at acquire,
copies' start and end, release, from CUDA events). Usage:
prefill9_ab.py MODEL [TOKENS=2048] [REPEATS=3] [ROUNDS=2] [FRACTION=0.25] [MODES=all/numba,all,slot-policy,slot]
A model of few layers warms the kernels (the disk cache) for a later process: pass REPEATS 0."""
import statistics
import sys
import time

import numpy as np

from moebus.bench.prefill import bench_prompt, prefill_flops
from moebus.cuda.kernels import compat
from moebus.cuda.kernels.compat import cuda
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel


def set_mode(cache, mode: str) -> None:
    cache.copy_fence = mode.split("/")[0]
    cache.copier.driver_copies = not mode.endswith("/numba") and not compat.SIMULATOR


def timeline(model, batch, cache) -> tuple[list[dict], float]:
    cache.timeline = []
    t = time.perf_counter()
    model.step(batch)
    wall = time.perf_counter() - t
    cache.copier.sync()
    entries, cache.timeline = cache.timeline, None
    t0 = entries[0]["compute_at_acquire"]
    ms = lambda ev: round(t0.elapsed_time(ev), 2) if ev is not None else None  # noqa: E731
    rows = [dict(layer=e["layer"], misses=e["misses"], runs=e.get("runs", 0), host_ms=round(e["host_s"] * 1e3, 2),
                 acq=ms(e["compute_at_acquire"]), cs=ms(e.get("copy_start")), ce=ms(e.get("copy_end")),
                 rel=ms(e.get("released"))) for e in entries]
    return rows, wall


def summary(rows, wall, blob_bytes, fence_all: bool) -> str:
    """One line: the step's wall and GPU span, the bytes copied and the copy stream's busy time (a
    layer's copies from its copy-stream start, or with the fence behind all the work from the compute
    stream at its acquire where that is later; in a chain a copy waiting for its fence counts as busy)."""
    copied = sum(r["misses"] for r in rows) * blob_bytes
    busy = sum(r["ce"] - (max(r["cs"], r["acq"]) if fence_all else r["cs"]) for r in rows if r["ce"] is not None)
    ends = [r["ce"] for r in rows if r["ce"] is not None]
    host = sum(r["host_ms"] for r in rows)
    return (f"wall {wall * 1e3:.1f} ms, GPU span (layer 0's acquire to the last release) {rows[-1]['rel'] or 0:.1f} ms, "
            f"copies {copied / 1e9:.2f} GB in {sum(r['runs'] for r in rows)} calls, copy stream busy {busy:.1f} ms = "
            f"{copied / max(busy, 1e-9) / 1e6:.1f} GB/s, last copy end {max(ends) if ends else 0:.1f} ms, "
            f"acquires' host time {host:.1f} ms")


def main() -> None:
    model_dir = sys.argv[1]
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    fraction = float(sys.argv[5]) if len(sys.argv) > 5 else 0.25
    modes = (sys.argv[6] if len(sys.argv) > 6 else "all/numba,all,slot-policy,slot").split(",")
    t_start = time.perf_counter()
    model = LocalModel(model_dir, device="cuda", num_slots=1, max_context=tokens + 16, cache_fraction=fraction,
                       kv_dtype="bf16")
    cfg = model.ckpt.config
    prompt = bench_prompt(tokens, cfg.vocab_size)
    batch = StepBatch(slots=[0], starts=[0], lengths=[tokens], tokens=prompt)
    cache = model.stages[0].experts
    print(f"loaded {fraction} cache ({cache.num_slots} slots of {cache.store.num_blobs}) in "
          f"{time.perf_counter() - t_start:.1f} s", flush=True)
    logits, times, misses = {}, {m: [] for m in modes}, {m: [] for m in modes}
    t = time.perf_counter()
    set_mode(cache, modes[0])
    model.step(batch)  # compiles and warms
    print(f"first step {time.perf_counter() - t:.1f} s", flush=True)
    for _ in range(rounds if repeats else 1):
        for mode in modes:
            set_mode(cache, mode)
            out = model.step(batch, want_logits=True)  # settles the cache into the mode's steady state
            logits.setdefault(mode, (out.tokens.copy(), out.logits.copy()))
            for _ in range(repeats):
                before = cache.misses
                t = time.perf_counter()
                model.step(batch)
                times[mode].append(time.perf_counter() - t)
                misses[mode].append(cache.misses - before)
            if repeats:
                print(f"{mode:>12}: runs {[round(x * 1e3, 1) for x in times[mode][-repeats:]]} ms, misses "
                      f"{misses[mode][-1]}, driver copies {cache.copier.driver_copies}", flush=True)
    if repeats:
        print(f"\nprefill {tokens} at a {fraction} cache, {cfg.num_layers} x {cfg.num_experts}: median of "
              f"{repeats * rounds} runs a mode")
        for mode in modes:
            med = statistics.median(times[mode])
            print(f"{mode:>12}: median {med * 1e3:.1f} ms = {tokens / med:,.0f} tok/s (best {tokens / min(times[mode]):,.0f},"
                  f" {prefill_flops(cfg, tokens) / med / 1e12:.1f} TFLOP/s), misses a run {statistics.median(misses[mode]):.0f}",
                  flush=True)
        for mode in modes:
            set_mode(cache, mode)
            model.step(batch)
            rows, wall = timeline(model, batch, cache)
            print(f"\ntimeline {mode}: {summary(rows, wall, cache.store.blob_bytes, mode.startswith('all'))}")
            print(" ".join(f"{k:>7}" for k in rows[0]))
            for r in rows:
                print(" ".join(f"{'' if v is None else v:>7}" for v in r.values()))
            sys.stdout.flush()
    del model, cache
    ref = LocalModel(model_dir, device="cuda", num_slots=1, max_context=tokens + 16, kv_dtype="bf16")
    out = ref.step(batch, want_logits=True)
    ref_times = []
    for _ in range(repeats):
        t = time.perf_counter()
        ref.step(batch)
        ref_times.append(time.perf_counter() - t)
    if ref_times:
        med = statistics.median(ref_times)
        print(f"\nall resident: runs {[round(x * 1e3, 1) for x in ref_times]} ms, median {med * 1e3:.1f} ms = "
              f"{tokens / med:,.0f} tok/s")
    ok = True
    for mode, (tok, lg) in logits.items():
        same = np.array_equal(tok, out.tokens) and np.array_equal(lg, out.logits)
        ok &= same
        print(f"{mode:>12} vs all resident: tokens and logits bit for bit {same} (max |dlogit| "
              f"{float(np.abs(lg - out.logits).max()):.1e})")
    print("PREFILL9 CHECK", "OK" if ok else "FAILED", f"({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
