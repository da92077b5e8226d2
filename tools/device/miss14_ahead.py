"""On the GPU, one process, one load of MODEL (48 x 32 A3B-shaped bf16) at a 25% cache with the tree's own
prefetch, fourteenth session (issue 15: a 25% cache at >= 0.90 / 0.85 of the PCIe bound of its misses at
batch 1 / 8): launch-ahead with a cache that evicts (workers/overlap.py, MOEBUS_CACHE_LAUNCH_AHEAD) against
the default (such a cache runs each step in turn: the host's ~2 ms between steps leaves the GPU and the link idle).

(1) check: LocalModel.decode with the switch on (steps launched ahead, admissions evicting meanwhile) == the
    same steps one at a time (model.step), same tokens and bit-identical logprobs, batch 1 and 8, STEPS steps
    (decode_tokens.py; the rows of a batch start from different ids);
(2) rounds: bench decode's own figures (``_in_process`` + ``_bounds``, as miss12_check.py prints them) with the
    switch off and on (``off``, ``ahead``) in turn, ROUNDS times at batch 1 and 8 (the runs' spread was 2-3%), then the medians;
(3) timelines (TIMELINES, ``label@batch``; miss_timeline.py's analysis of a CUPTI trace of 8 steps of
    LocalModel.decode): where the link is idle, between steps above all, with and without the switch;
(4) layer 0's guess: over one run's routing trace, how often an expert a sequence's step chose in layer 0 had
    been chosen in layer 0 by the step before (all of them, and those not resident at the end): what a
    prefetch of layer 0 from the step before could cover.
Usage: miss14_ahead.py MODEL [TOKENS]; ROUNDS, STEPS, BATCHES, TIMELINES, CHECK_BUDGET (seconds in all) from the environment."""
import os
import statistics
import sys
import time

import numpy as np

from moebus.bench.decode import _bounds, _in_process
from moebus.workers import overlap
from moebus.workers.local import LocalModel
from decode_tokens import decode_tokens, decode_tokens_ahead  # noqa: E402 - beside this script
from miss_timeline import analyse  # noqa: E402 - beside this script

model_dir, tokens = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 32
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,8").split(",") if b]
ROUNDS, STEPS = int(os.environ.get("ROUNDS", "3")), int(os.environ.get("STEPS", "8"))
TREE_DEFAULT = overlap.CACHE_LAUNCH_AHEAD  # restored after each run; the runs set it as their label says
deadline = time.time() + float(os.environ.get("CHECK_BUDGET", "1e9"))
prompt = [(7 * i + 3) % 200 + 10 for i in range(int(os.environ.get("PROMPT_TOKENS", "32")))]
t0 = time.perf_counter()
model = LocalModel(model_dir, device="cuda", num_slots=8, max_context=len(prompt) + max(tokens, STEPS) + 40,
                   cache_fraction=0.25, kv_dtype="bf16")
stage, cfg = model.stages[0], model.ckpt.config
cache = stage.experts
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":  # a dry run of this script: the simulator has no memory info
    cache.arena.memory_info = lambda: (0, 0)
print(f"loaded in {time.perf_counter() - t0:.1f}s: {cfg.num_layers} x {cfg.num_experts}, {cache.num_slots} slots, "
      f"{cache.num_reserved} banks, max admissions {cache.max_admissions}, graphs {stage.use_graphs}, cache launch-ahead by default {TREE_DEFAULT}", flush=True)


def check() -> bool:
    ok = True
    for batch in BATCHES:
        overlap.CACHE_LAUNCH_AHEAD = False
        plain = decode_tokens(model, prompt, batch, STEPS)[:2]
        overlap.CACHE_LAUNCH_AHEAD = True
        launched = []
        launch = overlap.launch
        overlap.launch = lambda *a, **k: launched.append(launch(*a, **k)) or launched[-1]
        try:
            ahead = decode_tokens_ahead(model, prompt, batch, STEPS)[:2]
        finally:
            overlap.launch, overlap.CACHE_LAUNCH_AHEAD = launch, TREE_DEFAULT
        same, dlp = np.array_equal(ahead[0], plain[0]), float(np.abs(ahead[1] - plain[1]).max())
        count = sum(x is not None for x in launched)
        ok &= same and dlp == 0.0 and count == STEPS
        print(f"batch {batch}: launched ahead {count} of {STEPS} vs one at a time: same tokens {same}, max |dlogprob| "
              f"{dlp:.1e}", flush=True)
    print("AHEAD CHECK", "OK" if ok else "FAILED", flush=True)
    return ok


def bench(label: str, batch: int) -> dict:
    overlap.CACHE_LAUNCH_AHEAD = label == "ahead"
    try:
        r = _in_process(model, prompt, tokens, batch, 2)
    finally:
        overlap.CACHE_LAUNCH_AHEAD = TREE_DEFAULT
    r.update(_bounds(r, cfg, cfg.num_layers, cache.store.blob_bytes, 50.0, 4800.0))
    r["of_bound"] = r["tok_s"] / r["pcie_bound_tok_s"] if r["pcie_bound_tok_s"] else float("nan")
    print(f"{label:>8} b{batch}: {r['tok_s']:.1f} tok/s, {r['ms_per_step']:.2f} ms, hit {r['hit_rate']:.3f}, bound "
          f"{r['pcie_bound_tok_s'] or float('nan'):.1f}, OF BOUND {r['of_bound']:.3f}, {r['h2d_gb_s']:.1f} GB/s, "
          f"needed {r['h2d_bytes_per_step'] / 1e6:.0f} MB, prefetched {r['prefetched_per_step']:.1f} used "
          f"{r['prefetch_used_per_step']:.1f}", flush=True)
    return r


def timeline(label: str, batch: int, steps: int = 8) -> None:
    from torch.profiler import ProfilerActivity, profile

    from moebus.workers.batch import StepBatch

    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(prompt)] * batch, tokens=prompt * batch))
    batches = (StepBatch(slots=range(batch), starts=[len(prompt) + i] * batch, lengths=[1] * batch,
                         tokens=[prompt[-1]] * batch) for i in range(steps))
    before = cache.stats()
    overlap.CACHE_LAUNCH_AHEAD = label == "ahead"
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for out in model.decode(batches):
                out.tokens.tolist()
    finally:
        overlap.CACHE_LAUNCH_AHEAD = TREE_DEFAULT
    moved = cache.stats()["h2d_bytes"] - before["h2d_bytes"]  # misses read, admissions, prefetches (used or not)
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    print(analyse([(e.name, e.time_range.start, e.time_range.end) for e in events], moved, steps,
                  f"{label} batch {batch}"), flush=True)


def layer0_guess(trace: list) -> str:
    """Of the experts each step chose in layer 0 (per sequence), the share the step before chose there too."""
    both = total = both_missed = missed = 0
    for before, now in zip(trace, trace[1:]):
        for t in range(now.shape[1]):
            prev, cur = set(before[0, t].tolist()), set(now[0, t].tolist())
            total += len(cur)
            both += len(cur & prev)
            off = {e for e in cur if cache.placement[0, e] < 0}  # not resident (the cache as it ended)
            missed += len(off)
            both_missed += len(off & prev)
    return (f"layer 0's experts chosen by the step before too: {both / max(total, 1):.2f} of {total}; "
            f"of those not resident: {both_missed / max(missed, 1):.2f} of {missed}")


ok = check()
rows = {}
for n in range(ROUNDS):
    for batch in BATCHES:
        for label in (("off", "ahead") if n % 2 == 0 else ("ahead", "off")):  # order alternates
            if time.time() > deadline - 8:
                break
            cache.trace = [] if (n, label) == (0, "ahead") else None
            rows.setdefault((label, batch), []).append(bench(label, batch))
            if cache.trace:
                print(f"  b{batch} {layer0_guess(cache.trace[-tokens:])}", flush=True)
            cache.trace = None
try:
    for v in [v for v in os.environ.get("TIMELINES", "off@8,ahead@8").split(",") if v]:
        if time.time() > deadline - 10:
            print("(budget: timelines cut here)", flush=True)
            break
        timeline(v.split("@")[0], int(v.split("@")[1]))
except Exception as e:  # no torch, or no CUPTI: the rest stands
    print("no timeline:", type(e).__name__, e, flush=True)
for (label, batch), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    med = {k: statistics.median(r[k] for r in runs) for k in ("tok_s", "of_bound", "ms_per_step", "hit_rate")}
    print(f"MEDIAN {label:>8} b{batch} over {len(runs)}: {med['tok_s']:.1f} tok/s, {med['ms_per_step']:.2f} ms, "
          f"OF BOUND {med['of_bound']:.3f}, hit {med['hit_rate']:.3f} (runs: "
          + " ".join(f"{r['of_bound']:.3f}" for r in runs) + ")", flush=True)
sys.exit(0 if ok else 1)
