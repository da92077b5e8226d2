"""On the GPU, one process, one load of MODEL at a 25% cache with the prefetch (experts.prefetch_slots):
(1) graph == eager with the prefetch, and the prefetch on == off (``cache.prefetch = None``; the banks
stay reserved), same tokens and bit-identical logprobs at batch 1 and 8; (2) bench decode's own
figures (``_in_process`` + ``_bounds``: tok/s, hit rate, PCIe bound, the prefetch's counters) with the
prefetch off and with each variant SLOTS:RANKS (bank slots a layer : predicted experts a token; the
first variant is the one checked). Usage: prefetch6_check.py MODEL [TOKENS] [SLOTS:RANKS,...]"""
import sys
import time

import numpy as np

from moebus.bench.decode import _bounds, _in_process
from moebus.workers.local import LocalModel
from moebus.workers.prefetch import Prefetch
from decode_tokens import decode_tokens  # noqa: E402 - beside this script

model_dir, tokens = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64
variants = [tuple(int(n) for n in v.split(":")) for v in (sys.argv[3] if len(sys.argv) > 3 else "4:8").split(",")]
slots = max(k for k, _ in variants)
prompt = [(7 * i + 3) % 200 + 10 for i in range(32)]
t0 = time.perf_counter()
model = LocalModel(model_dir, device="cuda", num_slots=8, max_context=len(prompt) + tokens + 8, cache_fraction=0.25,
                   prefetch_slots=slots, kv_dtype="bf16")
stage, cfg = model.stages[0], model.ckpt.config
cache = stage.experts


def variant(k: int, ranks: int):
    """A prefetch of k slots a layer (within the banks built) over each token's top-``ranks`` predicted."""
    return Prefetch(k, len(cache.store.layers), cfg.num_experts, ranks, cache.store.blob_bytes)


prefetch = variant(*variants[0]) if cache.prefetch is not None else None
print(f"loaded in {time.perf_counter() - t0:.1f}s: {cache.num_slots} slots, {cache.num_reserved} banks, "
      f"prefetch {'on' if prefetch else 'OFF'}, graphs {stage.use_graphs}", flush=True)


def set_prefetch(on) -> None:
    """The prefetch on or off; the captured graphs go (they hold the prefetch's kernels or not)."""
    cache.prefetch = on
    for graph in stage.graphs.values():
        graph.close()
    stage.graphs.clear()


def decode(batch, steps=12):
    return decode_tokens(model, prompt, batch, steps)[:2]


ok = True
for batch in (1, 8):
    graph = decode(batch)
    ok &= stage.use_graphs  # a capture that failed would have turned graphs off (and logged why)
    print(f"batch {batch}: graphs {stage.use_graphs}, captures {stage.graph_captures}", flush=True)
    stage.use_graphs = False
    eager = decode(batch)
    stage.use_graphs = True
    set_prefetch(None)
    plain = decode(batch)
    set_prefetch(prefetch)
    for name, other in (("eager+prefetch", eager), ("graph, no prefetch", plain)):
        same, dlp = np.array_equal(graph[0], other[0]), float(np.abs(graph[1] - other[1]).max())
        ok &= same and dlp == 0.0
        print(f"batch {batch} graph+prefetch vs {name}: same tokens {same}, max |dlogprob| {dlp:.1e}", flush=True)
print("PREFETCH CHECK", "OK" if ok else "FAILED", flush=True)
rows = []
for label, on in [("off", None)] + [(f"{k}:{r}", variant(k, r)) for k, r in variants]:
    set_prefetch(on)
    for batch in (1, 8):
        r = _in_process(model, prompt, tokens, batch, 2)
        r.update(_bounds(r, cfg, cfg.num_layers, cache.store.blob_bytes, 50.0, 4800.0))
        r["of_bound"] = r["tok_s"] / r["pcie_bound_tok_s"] if r["pcie_bound_tok_s"] else None
        rows.append((label, r))
        print(label, batch, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
print(f"\n{cfg.num_layers} x {cfg.num_experts}, 25% cache ({cache.num_slots} slots, {cache.num_reserved} of them banks),"
      f" {tokens} tokens x 2 repeats, median step")
print("k:ranks  batch    tok/s  hit_rate  pcie_bound  of_bound  h2d_GB/s  prefetched/step  used/step  wasted_MB/step")
for label, r in rows:
    print(f"{label:>8} {r['batch']:>5} {r['tok_s']:>8.1f} {r['hit_rate']:>9.3f} {r['pcie_bound_tok_s']:>11.1f} "
          f"{r['of_bound']:>9.3f} {r['h2d_gb_s']:>9.1f} {r['prefetched_per_step']:>16.2f} "
          f"{r['prefetch_used_per_step']:>10.2f} {r['prefetch_wasted_mb_per_step']:>15.1f}")
sys.exit(0 if ok else 1)
