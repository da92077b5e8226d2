"""A cache that evicts, launching ahead (workers/overlap.py, MOEBUS_CACHE_LAUNCH_AHEAD): allowed only
with the switch and no loan held, and then every admission's copy waits for the compute enqueued so
far (the step launched ahead reads its victims' slots until it ends). Real caches over the tiny model
on cpu, with a copier that records the fences it is given."""
import numpy as np

from moebus.common.checkpoint import Checkpoint
from moebus.cuda.backends import make_backend
from moebus.workers import overlap
from moebus.workers.expert_cache import SyncCopier
from moebus.workers.experts import build_expert_cache


class FencedCopier(SyncCopier):
    """Copies at once, as on cpu, but hands out compute-stream points and remembers each copy's."""

    fences = True

    def __init__(self, arena):
        super().__init__(arena)
        self.points, self.copies = 0, []

    def record_compute(self):
        self.points += 1
        return self.points

    def copy(self, slot, blob, after=None):
        self.copies.append((slot, after))
        return super().copy(slot, blob)


def cache(tiny_model, fraction=0.5):
    ckpt = Checkpoint(tiny_model)
    return build_expert_cache(ckpt, range(ckpt.config.num_layers), make_backend("cpu"), fraction=fraction)


def every_expert(c) -> np.ndarray:
    return np.tile(np.arange(c.store.num_experts, dtype=np.int32), (len(c.store.layers), 1, 1))


def test_a_cache_that_evicts_launches_ahead_only_with_the_switch_and_no_loan(tiny_model, monkeypatch):
    c = cache(tiny_model)
    monkeypatch.setattr(overlap, "CACHE_LAUNCH_AHEAD", False)  # MOEBUS_CACHE_LAUNCH_AHEAD=0
    assert not overlap.cache_allows_launch(c)
    monkeypatch.setattr(overlap, "CACHE_LAUNCH_AHEAD", True)  # the default
    assert overlap.cache_allows_launch(c)
    c.lend(2 * c.arena.slot_bytes)
    assert not overlap.cache_allows_launch(c)
    c.end_loan()
    assert overlap.cache_allows_launch(c)


def test_admissions_copy_after_the_compute_enqueued_before_them(tiny_model):
    c = cache(tiny_model)
    c.copier = FencedCopier(c.arena)
    missed = np.array([np.flatnonzero(row < 0)[:2] for row in c.placement], np.int32)[:, None, :]
    batches = []
    for _ in range(4):  # the same missed experts, step after step: they grow strong enough to be admitted
        done = len(c.copier.copies)
        c.observe(missed)
        batches.append(c.copier.copies[done:])
    admitted = [b for b in batches if b]
    assert admitted, "nothing admitted"
    for b in admitted:  # each step's copies: one fence, recorded as they were enqueued (after all the compute so far)
        assert {after for _, after in b} == {c.copier.points if b is admitted[-1] else b[0][1]}
        assert b[0][1] is not None
    assert [b[0][1] for b in admitted] == sorted({b[0][1] for b in admitted})  # a fresh one each step


def test_a_step_launched_ahead_counts_its_hits_against_the_table_it_read(tiny_model):
    c = cache(tiny_model)
    read = c.placement.copy()  # the table as the step was launched with it
    chosen = np.array([np.flatnonzero(row >= 0)[:1] for row in read], np.int32)[:, None, :]  # one hit a layer
    victim = int(chosen[0, 0, 0])
    c._evict(c.key_slot[victim])  # evicted (an admission's victim) before the step is collected
    before = (c.hits, c.misses, c.h2d_bytes)
    c.copier = FencedCopier(c.arena)
    c.max_admissions = 0
    c.observe(chosen, read=read)
    assert (c.hits - before[0], c.misses - before[1], c.h2d_bytes - before[2]) == (len(read), 0, 0)
    c.observe(chosen)  # against the table as it is now: the victim is a miss
    assert c.misses - before[1] == 1
