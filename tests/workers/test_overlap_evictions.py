"""When may a worker launch a decode step while the one before still runs (workers/overlap.py)? Only
while the expert cache cannot evict: the admissions that the running step's misses start must go to
free slots, which the launched step does not read. Real caches over the tiny model on cpu."""
import numpy as np

from moebus.common.checkpoint import Checkpoint
from moebus.cuda.backends import make_backend
from moebus.workers.experts import build_expert_cache
from moebus.workers.overlap import evicts_nothing


def cache(tiny_model, fraction=None):
    ckpt = Checkpoint(tiny_model)
    return build_expert_cache(ckpt, range(ckpt.config.num_layers), make_backend("cpu"), fraction=fraction)


def every_expert(c) -> np.ndarray:
    """One step's choices, (layers, 1, E): every expert of every layer."""
    return np.tile(np.arange(c.store.num_experts, dtype=np.int32), (len(c.store.layers), 1, 1))


def test_a_cache_of_every_expert_evicts_nothing(tiny_model):
    c = cache(tiny_model)
    assert not c.free and evicts_nothing(c)


def test_after_a_prompt_loan_the_experts_it_evicted_have_free_slots(tiny_model):
    c = cache(tiny_model)
    before = dict(c.key_slot)
    c.lend(3 * c.arena.slot_bytes)
    assert not evicts_nothing(c)  # during the loan (a prefill step: nothing is launched ahead then)
    c.end_loan()
    kept = dict(c.key_slot)
    assert len(kept) == len(before) - 3 and len(c.free) >= 3 and evicts_nothing(c)
    for _ in range(3):  # the evicted ones come back into free slots, and nothing else moves
        c.observe(every_expert(c))
        c.land_admissions(block=True)
        assert all(c.key_slot[k] == s for k, s in kept.items()) and evicts_nothing(c)
    assert set(c.key_slot) == set(before)


def test_a_cache_smaller_than_its_experts_may_evict(tiny_model):
    c = cache(tiny_model, fraction=0.5)
    assert not c.free and not evicts_nothing(c)
