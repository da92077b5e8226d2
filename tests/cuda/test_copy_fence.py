"""The expert cache's copies in a prefill (numba's simulator, the real StreamCopier over a device
arena): the misses of layer L wait only for the compute stream as it was when layer L-2's group was
released, and spare layer L-1's slots, whose kernels may still run; anything else between the groups
(a decode step, two groups in one layer) falls back to waiting for all the work so far."""
import numpy as np
import pytest

from moebus.cuda.memory.vmm import DeviceArena, StreamCopier
from moebus.workers.expert_cache import ExpertCache

NUM_LAYERS, NUM_EXPERTS, ELEMS = 6, 4, 64


class Store:
    num_experts = NUM_EXPERTS
    blob_bytes = ELEMS * 2

    def __init__(self):
        self.blobs = np.arange(NUM_LAYERS * NUM_EXPERTS * ELEMS, dtype=np.uint16).reshape(-1, ELEMS)

    def key(self, layer, expert):
        return layer * NUM_EXPERTS + int(expert)

    def blob(self, key):
        return self.blobs[key]


class Backend:
    def __init__(self):
        from numba import cuda

        self.stream = cuda.stream()


def make_cache(slots: int):
    arena = DeviceArena(ELEMS * 2, np.uint16, [ELEMS * 2 * slots])
    arena.grow()
    copier = StreamCopier(arena, Backend())
    afters = []  # the ``after`` of every copy, in order: the real copier records and copies
    copy = copier.copy
    copier.copy = lambda slot, blob, after=None: afters.append(after) or copy(slot, blob, after)
    events = []
    record = copier.record_compute
    copier.record_compute = lambda: events.append(record()) or events[-1]
    return ExpertCache(Store(), arena, copier, policy="freq", min_slots=NUM_EXPERTS), afters, events


def run_layer(cache, layer):
    slots, _ = cache.acquire(layer, range(NUM_EXPERTS))
    cache.wait()
    cache.release()
    return set(int(s) for s in slots)


def test_consecutive_layers_wait_for_the_group_before_last_and_spare_the_last():
    cache, afters, events = make_cache(slots=12)  # three layers' experts
    used = [run_layer(cache, layer) for layer in range(3)]
    assert afters[:8] == [None] * 8  # layers 0 and 1: no two groups before them in this pass
    assert all(a is events[0] for a in afters[8:12])  # layer 2: after layer 0's release
    for key in range(NUM_EXPERTS):  # layer 2's experts the weakest, then layer 1's
        for _ in range(2):
            cache.policy.touch(cache.store.key(0, key))
        cache.policy.touch(cache.store.key(1, key))
    used.append(run_layer(cache, 3))
    assert all(a is events[1] for a in afters[12:16])  # layer 3: after layer 1's release
    assert used[3] == used[1]  # layer 1's slots, not the weaker layer 2's: its kernels may still run
    cache.copier.sync()
    for layer in (0, 2, 3):
        for expert in range(NUM_EXPERTS):
            key = cache.store.key(layer, expert)
            assert (cache.arena.read(cache.key_slot[key]) == cache.store.blob(key)).all()


@pytest.mark.parametrize("between", ["decode step", "two groups in a layer", "a new pass"])
def test_anything_else_between_the_groups_waits_for_all_the_work(between):
    cache, afters, events = make_cache(slots=8)
    for layer in range(3):
        run_layer(cache, layer)
    assert afters[8:12] == [events[0]] * 4  # (layer 2 chained, as above)
    first = len(afters)
    if between == "decode step":
        cache.release()  # a step with no group releases without acquiring: slots were read outside groups
        run_layer(cache, 3)
    elif between == "two groups in a layer":
        cache.acquire(3, [0, 1])  # (chained: this group alone is layer 3's so far)
        first = len(afters)
        cache.acquire(3, [2, 3])
        cache.release()
        run_layer(cache, 4)
    else:
        run_layer(cache, 0)  # the next pass starts again at the stage's first layer
        run_layer(cache, 1)
    assert len(afters) > first and all(a is None for a in afters[first:])


def test_a_cache_too_small_to_spare_the_last_layer_waits_for_all_the_work():
    cache, afters, events = make_cache(slots=6)  # layer 2's misses must take layer 1's slots
    used = [run_layer(cache, layer) for layer in range(3)]
    assert len(afters) == 12 and afters[8:] == [None] * 4 and used[2] & used[1]
