"""A prefill's copies through a partial expert cache, chained on per-slot fences (expert_cache.py):
a model of the two streams (each group's kernels read its slots until its release's point of the
compute stream) checks that no copy can overwrite a slot before the last group that read it is done,
whatever the victims; the farthest-next-use victims keep most of the cache resident from pass to pass
(a 25% cache of 48 x 32: 1,200 misses a 2048-token prefill instead of 1,486) and let layer L's
copies wait only for layer L-2's release; anything that reads slots outside groups starts a new chain
behind all the work."""
import numpy as np
import pytest

from moebus.cuda.memory.arena import HostArena
from moebus.workers.expert_cache import ExpertCache

ELEMS = 4


class Store:
    def __init__(self, layers, experts):
        self.num_experts = experts
        self.blob_bytes = ELEMS * 2
        self.layers = list(range(layers))
        self.row_of_layer = {layer: layer for layer in self.layers}
        self.blobs = np.arange(layers * experts * ELEMS, dtype=np.uint16).reshape(-1, ELEMS)

    def key(self, layer, expert):
        return layer * self.num_experts + int(expert)

    def blob(self, key):
        return self.blobs[key]


class Fence:
    def __init__(self, seq):
        self.seq, self.event = seq, None


class ModelCopier:
    """The two streams as points: the compute stream's points count up (record_compute); a copy
    after fence f may run once the compute stream passed f; without one, after all recorded so far."""

    fences = True

    def __init__(self, arena):
        self.arena, self.seq, self.copies = arena, 0, []  # (first slot, count, the point it waits for)
        self.fenced = False

    def record_compute(self):
        self.seq += 1
        return Fence(self.seq)

    def record_copy(self):
        return None

    def copy(self, slot, blob, after=None):
        if after is None:
            after = self.record_compute() if not self.fenced else Fence(self.copies[-1][2])
            self.fenced = True
        count = blob.shape[0] if blob.ndim == 2 else 1
        self.arena.write(slot, blob)
        self.copies.append((slot, count, after.seq))
        return False

    def wait(self):
        self.fenced = False

    def mark(self):
        pass

    def is_done(self):
        return True

    def sync(self):
        pass


def make_cache(layers, experts, slots, mode="slot"):
    arena = HostArena(ELEMS * 2, np.uint16, [ELEMS * 2 * slots])
    arena.grow()
    copier = ModelCopier(arena)
    cache = ExpertCache(Store(layers, experts), arena, copier, policy="freq", min_slots=experts)
    cache.copy_fence = mode
    cache.preload()
    return cache, copier


def prefill(cache, copier, layers, experts, groups=1, readers=None, release_each=True):
    """One pass: each layer's experts in ``groups`` groups (acquire, wait, kernels, release; without
    ``release_each`` a layer's groups follow each other and the layer releases once, as
    moe_prefill._planned_on_host and Stage._moe do); ``readers`` gets (slot, point after its last
    read) for every slot a group read, and every copy is checked against it."""
    readers = {} if readers is None else readers
    misses = cache.misses
    for layer in range(layers):
        parts = np.array_split(np.arange(experts), groups)
        for n, part in enumerate(parts):
            first = len(copier.copies)
            slots, _ = cache.acquire(layer, part)
            for slot, count, after in copier.copies[first:]:
                for s in range(slot, slot + count):  # the copy runs after the last reader of its slot
                    assert after >= readers.get(s, 0), (layer, s, after, readers.get(s))
            cache.wait()
            done = copier.record_compute().seq  # the group's kernels are enqueued before this point
            if release_each or n == len(parts) - 1:
                cache.release()
            for slot in slots:
                readers[int(slot)] = done
            for expert, slot in zip(part, slots):  # the slot holds the expert's blob
                assert (cache.arena.array[slot] == cache.store.blob(cache.store.key(layer, expert))).all()
    cache.release()  # the step's end
    return cache.misses - misses


@pytest.mark.parametrize("mode", ["slot", "slot-policy", "all"])
@pytest.mark.parametrize("groups,release_each", [(1, True), (3, True), (3, False)])
def test_no_copy_overwrites_a_slot_before_its_last_reader_is_done(mode, groups, release_each):
    cache, copier = make_cache(layers=8, experts=6, slots=20, mode=mode)
    readers = {}
    for _ in range(3):
        prefill(cache, copier, 8, 6, groups, readers, release_each)
        readers = {slot: copier.record_compute().seq for slot in readers}  # a decode step reads any slot
        cache.observe(np.zeros((8, 1, 1), np.int64))


def test_farthest_next_use_keeps_most_of_the_cache_and_waits_for_the_layer_before_last():
    cache, copier = make_cache(layers=48, experts=32, slots=384)  # the H200's 25% cache of 48 x 32
    for _ in range(2):
        prefill(cache, copier, 48, 32)
    releases = []
    first = len(copier.copies)
    for layer in range(48):  # a third pass, layer by layer: which release each layer's copies wait for
        before = len(copier.copies)
        cache.acquire(layer, np.arange(32))
        waits = {after for _, _, after in copier.copies[before:]}
        if layer >= 2 and waits:
            assert max(waits) <= releases[layer - 2]  # not the layer before's: its kernels may still run
        cache.wait()
        cache.release()
        releases.append(copier.seq)
    cache.release()
    assert sum(count for _, count, _ in copier.copies[first:]) == 1200  # 1,486 with the policy's victims


def test_the_policys_victims_miss_every_pass_as_before():
    cache, copier = make_cache(layers=48, experts=32, slots=384, mode="all")
    assert [prefill(cache, copier, 48, 32) for _ in range(2)] == [1486, 1486]
    assert all(count == 1 for _, count, _ in copier.copies)


def test_consecutive_slots_and_keys_are_one_copy():
    cache, copier = make_cache(layers=4, experts=4, slots=8, mode="slot")
    cache.free = list(range(8))[::-1]  # all free, slots in order
    for slot in range(8):
        if cache.slot_key[slot] >= 0:
            cache._evict(slot)
    first = len(copier.copies)
    cache.acquire(2, np.arange(4))
    assert copier.copies[first:] == [(0, 4, copier.copies[first][2])]
    assert (cache.arena.array[:4] == cache.store.blobs[8:12]).all()


@pytest.mark.parametrize("between", ["decode step", "step end", "loan"])
def test_anything_that_reads_slots_outside_groups_starts_a_new_chain(between):
    cache, copier = make_cache(layers=6, experts=4, slots=12)
    for layer in range(3):
        cache.acquire(layer, np.arange(4))
        cache.release()
    chain = cache._chain
    assert chain is not None
    if between == "decode step":
        cache.device_placement(type("Ops", (), {"persist": staticmethod(np.array), "overwrite": lambda *a: None})())
    elif between == "step end":
        cache.release()
    else:
        cache.lend(0)
        cache.end_loan()
    assert cache._chain is None
    point = copier.seq
    before = len(copier.copies)
    cache.acquire(3, np.arange(4))
    assert len(copier.copies) > before and all(after > point for _, _, after in copier.copies[before:])


def test_an_unknown_fence_setting_is_refused(monkeypatch):
    from moebus.workers import expert_cache

    monkeypatch.setattr(expert_cache, "COPY_FENCE", "some")
    with pytest.raises(ValueError, match="MOEBUS_PREFILL_COPY_FENCE"):
        make_cache(layers=2, experts=2, slots=4)


def test_a_store_whose_rows_are_not_its_keys_is_copied_a_blob_at_a_time():
    """bench vram's store: keys past its rows wrap around; no run may read past or beside them."""
    cache, copier = make_cache(layers=2, experts=4, slots=8)
    store = cache.store
    wrapped = store.blobs[:4]
    store.blob = lambda key: wrapped[key % 4]
    del store.row_of_layer
    cache.free = list(range(8))[::-1]
    for slot in range(8):
        if cache.slot_key[slot] >= 0:
            cache._evict(slot)
    first = len(copier.copies)
    cache.acquire(1, np.arange(4))
    assert [count for _, count, _ in copier.copies[first:]] == [1, 1, 1, 1]
    assert (cache.arena.array[:4] == wrapped).all()


def test_decodes_hot_experts_stay_through_prefills():
    """The chain's victims among the released slots are the policy's weakest: the experts decode steps
    use keep their slots through prefills larger than the cache (the latest release first alone kept
    ~50 of these 144), at the same misses."""
    cache, copier = make_cache(layers=48, experts=32, slots=384)
    hot = np.array([layer * 32 + e for layer in range(48) for e in (3, 17, 29)])
    for _ in range(3):
        for _ in range(20):
            cache.policy.observe(hot)  # decode steps choose them
        assert prefill(cache, copier, 48, 32) == 1200
        assert all(int(k) in cache.key_slot for k in hot)


def test_a_new_chain_evicts_the_weakest_of_the_farthest_layer_first():
    """Every slot of a chain's first group is one no group of it read (a prompt chunk that spans
    steps starts a chain each step): the layer farthest ahead goes first, and within it the policy's
    weakest, so the decode steps' hot expert of that layer stays (was: the lowest slot)."""
    cache, _ = make_cache(layers=2, experts=4, slots=6)  # preloaded (0,0) (1,0) (0,1) (1,1) (0,2) (1,2)
    hot = cache.store.key(1, 0)
    assert cache.key_slot[hot] == 1
    for _ in range(3):
        cache.policy.touch(hot)
    cache.acquire(0, [3])  # a miss in layer 0: one victim from layer 1, the farthest ahead
    cache.release()
    assert hot in cache.key_slot and cache.store.key(0, 3) in cache.key_slot
    assert sum(cache.store.key(1, e) in cache.key_slot for e in range(4)) == 2  # a cold one of layer 1 went
