"""On the GPU, one process, one load of MODEL at a 25% cache with the prefetch's banks built
(experts.prefetch_slots = the largest variant's slots), tenth session (issue 15 item 2):

(1) check: graph + prefetch (the first variant) == graph without the prefetch, same tokens and
    bit-identical logprobs at batch 1 and 8 (batch 8 on the expert path the tree picks);
(2) variants: bench decode's own figures (``_in_process`` + ``_bounds``: tok/s, hit rate, PCIe bound at
    50 GB/s, share of it, PCIe GB/s, the prefetch's counters) with the prefetch off and each SLOTS:RANKS
    (bank slots a layer : predicted experts a token), at batch 1 and 8; ``gemv`` after a variant: batch 8
    on the GEMV expert kernels instead of the tiles (moe_prefill.DECODE_PAIRS_PER_EXPERT 0), ``tiles``:
    in tiles though the cache is partial (expert_cache.MISSES_IN_GEMVS_UP_TO 0; 8 by default since this
    session, so a plain variant's batch 8 runs on the GEMVs);
(3) timeline (torch.profiler's CUPTI trace of replayed steps, if torch imports): per step the wall
    time, the GPU's busy time (union of kernel intervals), the kernels' summed time (> busy where the
    side branch overlaps), the expert kernels' busy time (their reads of missed experts: PCIe) and
    the busy time with no expert kernel running (PCIe idle but for prefetch copies), by kernel;
(4) mapped reads: the prefetch's copy kernel alone, K experts from the mapped host store into arena
    slots, at 16/32/64 blocks a slot (GB/s, CUDA events).
Usage: miss10_check.py MODEL [TOKENS] [SLOTS:RANKS[:gemv|:tiles][:bN][:logits],...] [PROFILED]"""
import os
import sys
import time

import numpy as np

from moebus.bench.decode import _bounds, _in_process
from moebus.workers import expert_cache, moe_prefill
from moebus.workers.local import LocalModel
from moebus.workers.prefetch import Prefetch
from decode_tokens import decode_tokens  # noqa: E402 - beside this script

model_dir, tokens = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 32
variants = [v.split(":") for v in (sys.argv[3] if len(sys.argv) > 3 else "2:2").split(",")]
profiled = (sys.argv[4] if len(sys.argv) > 4 else "off,2:2").split(",")
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,8").split(",") if b]  # fewer under the simulator
deadline = time.time() + float(os.environ.get("CHECK_BUDGET", "1e9"))
slots = max(int(v[0]) for v in variants if v[0] != "off")
prompt = [(7 * i + 3) % 200 + 10 for i in range(int(os.environ.get("PROMPT_TOKENS", "32")))]
t0 = time.perf_counter()
model = LocalModel(model_dir, device="cuda", num_slots=8, max_context=len(prompt) + tokens + 40, cache_fraction=0.25,
                   prefetch_slots=slots, kv_dtype="bf16")
stage, cfg = model.stages[0], model.ckpt.config
cache = stage.experts
TILES, MISSES_UP_TO = moe_prefill.DECODE_PAIRS_PER_EXPERT, expert_cache.MISSES_IN_GEMVS_UP_TO
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":  # a dry run of this script: the simulator has no memory info
    cache.arena.memory_info = lambda: (0, 0)
print(f"loaded in {time.perf_counter() - t0:.1f}s: {cfg.num_layers} x {cfg.num_experts}, {cache.num_slots} slots, "
      f"{cache.num_reserved} banks, graphs {stage.use_graphs}, tiles from {TILES} pairs an expert", flush=True)


def make(v):
    """(label, prefetch or None, tiles: None as the tree decides, False never, True even with misses)
    of a variant SLOTS:RANKS[:gemv|:tiles][:bN][:logits] or off[...]; bN: the copy kernel's blocks a
    slot (cuda/kernels/prefetch.COPY_BLOCKS_PER_SLOT, 16); logits: top-k and plan in one kernel
    (workers/prefetch.PLAN_FROM_LOGITS), both while the variant runs."""
    from moebus.cuda.kernels import prefetch as kernels
    from moebus.workers import prefetch as prefetch_module

    prefetch_module.PLAN_FROM_LOGITS = "logits" in v

    tiles = False if "gemv" in v else True if "tiles" in v else None
    kernels.COPY_BLOCKS_PER_SLOT = next((int(f[1:]) for f in v[2:] if f.startswith("b")), 16)
    if v[0] == "off":
        return ":".join(v), None, tiles
    return ":".join(v), Prefetch(int(v[0]), len(cache.store.layers), cfg.num_experts, int(v[1]),
                                 cache.store.blob_bytes), tiles


def use(prefetch, tiles=None) -> None:
    """The prefetch on or off, tiles or GEMVs; the captured graphs go (they hold the old kernels)."""
    cache.prefetch = prefetch
    moe_prefill.DECODE_PAIRS_PER_EXPERT = 0 if tiles is False else TILES
    expert_cache.MISSES_IN_GEMVS_UP_TO = 0 if tiles is True else MISSES_UP_TO
    for graph in stage.graphs.values():
        graph.close()
    stage.graphs.clear()


first = make(next(v for v in variants if v[0] != "off"))
ok = True
for batch in BATCHES:
    use(first[1])
    graph = decode_tokens(model, prompt, batch, 8)[:2]
    ok &= stage.use_graphs  # a capture that failed would have turned graphs off (and logged why)
    use(None)
    plain = decode_tokens(model, prompt, batch, 8)[:2]
    same, dlp = np.array_equal(graph[0], plain[0]), float(np.abs(graph[1] - plain[1]).max())
    ok &= same and dlp == 0.0
    print(f"batch {batch}: graph+prefetch {first[0]} vs graph without: same tokens {same}, max |dlogprob| {dlp:.1e}, "
          f"graphs {stage.use_graphs}", flush=True)
print("PREFETCH CHECK", "OK" if ok else "FAILED", flush=True)

rows = []
for v in [["off"]] + variants:
    label, prefetch, tiles = make(v)
    use(prefetch, tiles)
    for batch in BATCHES if tiles is None else [b for b in BATCHES if b > 1]:
        if time.time() > deadline - 40:
            print("(budget: variants cut here)", flush=True)
            break
        r = _in_process(model, prompt, tokens, batch, 2)
        r.update(_bounds(r, cfg, cfg.num_layers, cache.store.blob_bytes, 50.0, 4800.0))
        r["of_bound"] = r["tok_s"] / r["pcie_bound_tok_s"] if r["pcie_bound_tok_s"] else float("nan")
        rows.append((label, r))
        print(label, batch, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
print(f"\n{cfg.num_layers} x {cfg.num_experts}, 25% cache ({cache.num_slots} slots, {cache.num_reserved} of them banks),"
      f" {tokens} tokens x 2 repeats, median step")
print("k:ranks  batch    tok/s  ms/step  hit_rate  pcie_bound  of_bound  h2d_GB/s  prefetched/step  used/step  "
      "wasted_MB/step")
for label, r in rows:
    print(f"{label:>9} {r['batch']:>5} {r['tok_s']:>8.1f} {r['ms_per_step']:>8.2f} {r['hit_rate']:>9.3f} "
          f"{r['pcie_bound_tok_s'] or float('nan'):>11.1f} {r['of_bound']:>9.3f} {r['h2d_gb_s']:>9.1f} "
          f"{r['prefetched_per_step']:>16.2f} "
          f"{r['prefetch_used_per_step']:>10.2f} {r['prefetch_wasted_mb_per_step']:>15.1f}", flush=True)


def union_us(intervals) -> float:
    total, end = 0.0, -1e30
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def timeline(label, prefetch, batch, tiles=None, steps=8) -> None:
    from torch.profiler import ProfilerActivity, profile

    from moebus.workers.batch import StepBatch
    from decode_profile import short_name

    use(prefetch, tiles)
    decode_tokens(model, prompt, batch, 4)  # captured, warm
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(prompt)] * batch, tokens=prompt * batch))
    last = [prompt[-1]] * batch
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            out = model.step(StepBatch(slots=range(batch), starts=[len(prompt) + i] * batch, lengths=[1] * batch,
                                       tokens=last))
            last = [int(t) for t in out.tokens]
        wall_us = (time.perf_counter() - start) * 1e6 / steps
    kernels = [(short_name(e.name), e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type.name == "CUDA" and e.device_time_total > 0]
    is_expert = [("moe_ffn" in n or any(w in n.lower() for w in ("gemm", "cutlass", "sm90", "nvjet")))
                 for n, _, _ in kernels]
    # cuBLAS also runs the dense products at batch 8 (few rows): counted with the experts there, see the table
    spans = [(a, b) for _, a, b in kernels]
    busy = union_us(spans) / steps
    expert_busy = union_us([s for s, e in zip(spans, is_expert) if e]) / steps
    summed = sum(b - a for a, b in spans) / steps
    copy_busy = union_us([(a, b) for n, a, b in kernels if "copy_rows" in n]) / steps
    print(f"-- timeline {label} batch {batch}: wall {wall_us:.0f} us/step, GPU busy {busy:.0f}, kernels summed "
          f"{summed:.0f} (overlap {summed - busy:.0f}), expert kernels busy {expert_busy:.0f}, busy without an "
          f"expert kernel {busy - expert_busy:.0f}, prefetch copies busy {copy_busy:.0f}", flush=True)
    by_name = {}
    for n, a, b in kernels:
        c = by_name.setdefault(n, [0, 0.0])
        c[0] += 1
        c[1] += b - a
    for n, (calls, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:9]:
        print(f"   {n[:56]:<56} {calls / steps:>6.1f}/step {us / calls:>8.1f} us {us / steps:>8.0f} us/step")


try:
    import torch  # noqa: F401 - the profiler's

    for v in profiled:
        for batch in BATCHES:
            if time.time() > deadline - 20:
                print("(budget: timelines cut here)", flush=True)
                break
            label, prefetch, tiles = make(v.split(":"))
            timeline(label, prefetch, batch, tiles)
except Exception as e:  # no torch, or no CUPTI: the rest goes on
    print("no timeline:", type(e).__name__, e, flush=True)


def mapped_reads() -> None:
    """The copy kernel alone: K host-store rows (mapped) into bank slots, GB/s over PCIe."""
    from numba import cuda

    from moebus.cuda.kernels import prefetch as kernels

    ops = stage.ops
    store, arena = cache.store.device_blobs, cache.array
    for k in (1, 2, 4):
        keys = ops.persist(np.arange(10, 10 + k, dtype=np.int32) * 3)
        for per_slot in (16, 32, 64):
            kernels.COPY_BLOCKS_PER_SLOT = per_slot
            kernels.copy_prefetch_cuda(keys, store, arena, 0)
            begin, end = cuda.event(), cuda.event()
            begin.record()
            for _ in range(5):
                kernels.copy_prefetch_cuda(keys, store, arena, 0)
            end.record()
            end.synchronize()
            s = begin.elapsed_time(end) / 1e3 / 5
            print(f"copy_rows: {k} experts ({k * cache.store.blob_bytes / 1e6:.1f} MB), {per_slot} blocks a slot: "
                  f"{s * 1e6:.0f} us, {k * cache.store.blob_bytes / s / 1e9:.1f} GB/s", flush=True)
    kernels.COPY_BLOCKS_PER_SLOT = 16


if time.time() < deadline - 5 and os.environ.get("MAPPED_READS", "1") == "1":
    use(None)
    mapped_reads()
sys.exit(0 if ok else 1)
