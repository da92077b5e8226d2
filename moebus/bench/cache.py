"""``moebus bench cache``: routing traces replayed through the expert cache's decode path (observe:
hits, misses, admissions) for each policy and cache fraction; prints hit rates. Pure CPU.

Traces are (steps, MoE layers, T, A) expert ids:
- ``synthetic``: per sequence and layer, each pick repeats one of the previous token's experts with
  probability ``--repeat`` (0.28), else one from 2..8 tokens back with ``--recent`` (0.22), else a
  draw from a skewed per-layer popularity (which lands on recent experts too). The defaults give the
  reuse reported for Qwen3-30B-A3B (~45% of picks repeat at the next token, ~80% within 8); the
  reuse actually realised is printed beside the hit rates.
- ``recorded``: the choices of a real decode run of ``--model`` (the demo model by default) on cpu.

Policies: ``freq`` (default), ``lru`` (both with the cache's admission cap per step) and ``lru-all``
(LRU admitting every miss at once, as the cache did before misses could be read in place)."""
from __future__ import annotations

import argparse
import json

import numpy as np

from moebus.cuda.memory.arena import HostArena
from moebus.workers.expert_cache import ExpertCache

BLOB_ELEMS = 1024  # the bytes do not matter here: 2 KiB slots keep the arena small


class TraceStore:
    """A host store of placeholder blobs, keyed as HostStore keys (layer row * E + expert)."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_experts = num_experts
        self.layers = list(range(num_layers))
        self.dtype = np.dtype(np.uint16)
        self.blob_bytes = BLOB_ELEMS * 2
        self.blobs = np.zeros((num_layers * num_experts, BLOB_ELEMS), np.uint16)

    def key(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + int(expert)

    def blob(self, key: int) -> np.ndarray:
        return self.blobs[key]


def synthetic_trace(steps: int, layers: int, experts: int, batch: int, top_k: int, repeat: float, recent: float,
                    seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(experts, 0.3), size=layers)  # skewed, as trained routers are
    trace = np.empty((steps, layers, batch, top_k), np.int32)
    for step in range(steps):
        for layer in range(layers):
            for seq in range(batch):
                trace[step, layer, seq] = _picks(rng, trace[max(0, step - 8):step, layer, seq], popularity[layer],
                                                 top_k, repeat, recent)
    return trace


def _picks(rng, history: np.ndarray, popularity: np.ndarray, top_k: int, repeat: float, recent: float):
    chosen: list[int] = []
    previous = history[-1].tolist() if len(history) else []
    older = history[:-1].reshape(-1).tolist() if len(history) > 1 else []
    while len(chosen) < top_k:
        r = rng.random()
        pool = previous if r < repeat else older if r < repeat + recent else None
        pool = [e for e in pool if e not in chosen] if pool else None
        e = int(rng.choice(pool)) if pool else int(rng.choice(len(popularity), p=popularity))
        if e not in chosen:
            chosen.append(e)
    return chosen


def reuse(trace: np.ndarray) -> tuple[float, float]:
    """(share of picks also chosen by the previous token, share chosen within the 8 before)."""
    steps = trace.shape[0]
    next_hits = within = total = 0
    for step in range(1, steps):
        now = trace[step]
        prev = trace[step - 1]
        window = trace[max(0, step - 8):step]
        for layer in range(now.shape[0]):
            for seq in range(now.shape[1]):
                picks = now[layer, seq]
                next_hits += np.isin(picks, prev[layer, seq]).sum()
                within += np.isin(picks, window[:, layer, seq]).sum()
                total += len(picks)
    return next_hits / max(total, 1), within / max(total, 1)


def recorded_trace(model_dir: str, steps: int, batch: int) -> np.ndarray:
    from moebus.workers.batch import StepBatch
    from moebus.workers.local import LocalModel

    model = LocalModel(model_dir, device="cpu", num_slots=batch, max_context=steps + 40)
    cache = model.stages[0].experts
    prompt = [(7 * i + 3) % 200 + 10 for i in range(16)]
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[16] * batch, tokens=prompt * batch))
    cache.trace = []  # decode steps only
    last = [prompt[-1] + s for s in range(batch)]
    for i in range(steps):
        out = model.step(StepBatch(slots=range(batch), starts=[16 + i] * batch, lengths=[1] * batch, tokens=last,
                                   temperature=[0.8] * batch, u=np.random.default_rng(i).random(batch)))
        last = [int(t) for t in out.tokens]
    return np.stack(cache.trace)


def replay(trace: np.ndarray, num_experts: int, fraction: float, policy: str) -> dict:
    layers = trace.shape[1]
    store = TraceStore(layers, num_experts)
    slots = max(trace.shape[3], int(layers * num_experts * fraction))
    arena = HostArena(store.blob_bytes, store.dtype, [slots * store.blob_bytes])
    arena.grow()
    uncapped = policy == "lru-all"
    cache = ExpertCache(store, arena, policy="lru" if uncapped else policy,
                        max_admissions=slots if uncapped else None)
    cache.preload()
    warmup = len(trace) // 10
    for step, chosen in enumerate(trace):
        if step == warmup:
            cache.hits = cache.misses = cache.h2d_bytes = 0
        cache.observe(chosen)
    counted = len(trace) - warmup
    lookups = max(cache.hits + cache.misses, 1)
    return {"hit_rate": cache.hits / lookups, "h2d_experts_per_step": cache.h2d_bytes / store.blob_bytes / counted}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench cache")
    p.add_argument("--trace", default="synthetic,recorded")
    p.add_argument("--model", help="model for the recorded trace (default: the embedded demo model)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--layers", type=int, default=12, help="synthetic: MoE layers")
    p.add_argument("--experts", type=int, default=128, help="synthetic: experts per layer")
    p.add_argument("--top-k", type=int, default=8, help="synthetic: experts per token")
    p.add_argument("--repeat", type=float, default=0.28)
    p.add_argument("--recent", type=float, default=0.22)
    p.add_argument("--fractions", default="0.1,0.25,0.5")
    p.add_argument("--policies", default="freq,lru,lru-all")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    policies = args.policies.split(",")
    for kind in args.trace.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            trace, experts = _trace(kind, args, batch)
            next_share, window_share = reuse(trace)
            print(f"== {kind} trace: {trace.shape[0]} steps, {trace.shape[1]} layers x {experts} experts, batch "
                  f"{batch}, top-{trace.shape[3]}; picks repeating at the next token {next_share:.2f}, "
                  f"within 8 {window_share:.2f}")
            print(f"{'fraction':>8}  " + "  ".join(f"{pol:>16}" for pol in policies))
            for fraction in fractions:
                rows = {pol: replay(trace, experts, fraction, pol) for pol in policies}
                print(f"{fraction:>8}  " + "  ".join(
                    f"{r['hit_rate']:>7.3f} ({r['h2d_experts_per_step']:>5.1f}/st)" for r in rows.values()))
                if args.json:
                    for pol, r in rows.items():
                        print(json.dumps({"trace": kind, "batch": batch, "fraction": fraction, "policy": pol, **r}))
    print("(hit rate over the steps after the first 10%; in brackets: experts over PCIe per step, misses read in "
          "place plus admissions)")
    return 0


def _trace(kind: str, args, batch: int) -> tuple[np.ndarray, int]:
    if kind == "synthetic":
        return synthetic_trace(args.steps, args.layers, args.experts, batch, args.top_k, args.repeat,
                               args.recent), args.experts
    if kind == "recorded":
        from moebus.common.checkpoint import Checkpoint
        from moebus.common.demo_model import demo_model_dir

        model_dir = args.model or str(demo_model_dir())
        return recorded_trace(model_dir, args.steps, batch), Checkpoint(model_dir).config.num_experts
    raise ValueError(f"unknown trace {kind!r}")
