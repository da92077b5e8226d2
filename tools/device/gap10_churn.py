"""The expert cache's traffic while a prompt chunk spans steps beside two decoding streams, on the cpu:
the real ExpertCache (freq policy, admissions, the prompt-path loan, a prefill's chained copies and
farthest-next-use victims through a fenced model copier as in tests/workers/test_copy_chain.py) and
the chunk's group sizing (chunk_advance.group_end), with synthetic routing. Bookkeeping only: counts
of experts, turned into MiB at the H200 model's 9 MiB an expert and ms at 33 GB/s; no kernel runs.

Shape of gap10.sh's cycle: 8 layers x 128 experts, a cache of 493 slots (the hand-back's (c)), a loan
of 42 slots (510 tokens at the measured 764 KiB a token), two streams decoding (each token 7 of its 8
choices from 24 experts that stream keeps using in each layer, 1 at random), a chunk that chooses
every expert of every layer (510 tokens x 8), chunk steps and decode-only (look-ahead) steps in turn.
Compares the loan taken and returned each chunk step (gap9) with it held to the chunk's end (gap10).

    python3 tools/device/gap10_churn.py [BUDGET_MIB ...]"""
from __future__ import annotations

import sys

import numpy as np

from moebus.cuda.memory.arena import HostArena
from moebus.workers.chunk_advance import group_end
from moebus.workers.expert_cache import ExpertCache

LAYERS, EXPERTS, TOP_K, STREAMS = 8, 128, 8, 2
SLOTS, LOAN_SLOTS, MAX_ADMISSIONS = 493, 42, 691 // 16  # (c); the loan; the worker's arena (691 slots) / 16
BLOB_MIB, LINK_GB_S = 9.0, 33.0
ELEMS = 4
HOT, HOT_CHOICES = 24, 7


class Store:
    def __init__(self):
        self.num_experts, self.blob_bytes = EXPERTS, int(BLOB_MIB * 2 ** 20)  # what a budget counts
        self.layers = list(range(LAYERS))
        self.row_of_layer = {layer: layer for layer in self.layers}
        self.blobs = np.zeros((LAYERS * EXPERTS, ELEMS), np.uint16)

    def key(self, layer, expert):
        return layer * EXPERTS + int(expert)

    def blob(self, key):
        return self.blobs[key]


class Fence:
    def __init__(self, seq):
        self.seq, self.event = seq, None


class ModelCopier:
    """Copies complete at once; fences are points of a counter (tests/workers/test_copy_chain.py)."""
    fences = True

    def __init__(self, arena):
        self.arena, self.seq, self.count = arena, 0, 0

    def record_compute(self):
        self.seq += 1
        return Fence(self.seq)

    def copy(self, slot, blob, after=None):
        self.arena.write(slot, blob)
        self.count += blob.shape[0] if blob.ndim == 2 else 1
        return False

    def wait(self): pass
    def mark(self): pass
    def is_done(self): return True
    def sync(self): pass


def make_cache():
    arena = HostArena(ELEMS * 2, np.uint16, [ELEMS * 2 * SLOTS])
    arena.grow()
    copier = ModelCopier(arena)
    cache = ExpertCache(Store(), arena, copier, policy="freq", min_slots=TOP_K, max_admissions=MAX_ADMISSIONS)
    cache.preload()
    return cache, copier


def decode_choices(rng, hot):
    """(layers, streams, top_k) expert ids: mostly each stream's own hot experts of the layer."""
    out = np.empty((LAYERS, STREAMS, TOP_K), np.int64)
    for layer in range(LAYERS):
        for s in range(STREAMS):
            picks = list(rng.choice(hot[layer, s], HOT_CHOICES, replace=False))
            while len(picks) < TOP_K:
                e = int(rng.integers(EXPERTS))
                if e not in picks:
                    picks.append(e)
            out[layer, s] = picks
    return out


def decode(cache, copier, rng, hot) -> tuple[int, int]:
    """One decode step: (misses read in place, experts admitted)."""
    misses, copies = cache.misses, copier.count
    cache.observe(decode_choices(rng, hot))
    return cache.misses - misses, copier.count - copies


def chunk_step(cache, copier, state, budget_bytes) -> int:
    """The chunk's groups within the budget (chunk_advance._run_groups' sizing); its copies."""
    copies, spent, ran = copier.count, 0, False
    unique = np.arange(EXPERTS)
    while state["layer"] < LAYERS:
        end, cost = group_end(cache, state["layer"], unique, state["next"], budget_bytes - spent, must_run=not ran)
        if end == state["next"]:
            break
        cache.acquire(state["layer"], unique[state["next"]:end])
        cache.wait()
        spent, ran, state["next"] = spent + cost, True, end
        if end == EXPERTS:
            state["layer"], state["next"] = state["layer"] + 1, 0
    cache.release()
    return copier.count - copies


def run(budget_mib: float, held: bool, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    hot = np.stack([[rng.choice(EXPERTS, HOT, replace=False) for _ in range(STREAMS)] for _ in range(LAYERS)])
    cache, copier = make_cache()
    steady = [decode(cache, copier, rng, hot) for _ in range(300)][-100:]
    state = {"layer": 0, "next": 0}
    budget = int(budget_mib * 2 ** 20)
    rows = {"chunk": [], "between": []}
    while state["layer"] < LAYERS:
        if cache.loaned_from is None:
            cache.lend(LOAN_SLOTS * cache.arena.slot_bytes)
        missed, admitted = decode(cache, copier, rng, hot)  # the decode rows first
        chunk = chunk_step(cache, copier, state, budget)
        if not held or state["layer"] == LAYERS:
            cache.end_loan()
        rows["chunk"].append((missed, admitted, chunk))
        if state["layer"] < LAYERS:
            rows["between"].append(decode(cache, copier, rng, hot) + (0,))
    return {"steady": np.mean(steady, axis=0), **{k: np.array(v) for k, v in rows.items()}}


def mib_ms(missed, admitted, chunk) -> tuple[float, float]:
    mib = (missed + admitted + chunk) * BLOB_MIB
    return mib, mib / 1024 / LINK_GB_S * 1e3


def main(budgets) -> None:
    print(f"{LAYERS} x {EXPERTS} experts, {SLOTS} slots, loan {LOAN_SLOTS}, {STREAMS} streams; per step: decode misses"
          f" read in place / admissions / the chunk's copies; MiB at {BLOB_MIB} MiB an expert, ms at {LINK_GB_S} GB/s")
    for budget in budgets:
        for held in (False, True):
            r = run(budget, held)
            s_missed, s_admitted = r["steady"]
            print(f"budget {budget:>5.0f} MiB, loan {'held to the end' if held else 'taken each step'}: "
                  f"{len(r['chunk'])} chunk steps; steady decode {s_missed:.1f} / {s_admitted:.1f} "
                  f"({mib_ms(s_missed, s_admitted, 0)[1]:.1f} ms)")
            for name in ("chunk", "between"):
                rows = r[name]
                if not len(rows):
                    continue
                mean = rows.mean(axis=0)
                worst = max(mib_ms(*row)[1] for row in rows)
                mib, ms = mib_ms(*mean)
                print(f"  {name:>8} steps: {mean[0]:5.1f} / {mean[1]:5.1f} / {mean[2]:5.1f}  {mib:6.0f} MiB"
                      f"  {ms:5.1f} ms (largest {worst:.1f})")


if __name__ == "__main__":
    main([float(b) for b in sys.argv[1:]] or [256.0, 128.0])
