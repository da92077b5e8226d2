"""ExpertCache over the cpu arena and an emulated GPU's ledger: exact slots, eviction order, and a
hypothesis state machine over lookups, pins, shrinks, grows and bare resets."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from moebus.cuda.memory.arena import Arena, HostArena
from moebus.cuda.memory.ledger import MIB, EmulatedGpu
from moebus.cuda.kernels.routing import host_placement
from moebus.workers.expert_cache import EMPTY, ExpertCache

BLOB_ELEMS = 256 * 1024  # 512 KiB of bf16 bits: 4 slots per 2 MiB segment
NUM_LAYERS, NUM_EXPERTS = 3, 6


class FakeStore:
    """A host store of random blobs (the real one is tested through the model)."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.num_experts = NUM_EXPERTS
        self.dtype = np.dtype(np.uint16)
        self.blob_bytes = BLOB_ELEMS * 2
        self.blobs = rng.integers(0, 1 << 16, size=(NUM_LAYERS * NUM_EXPERTS, BLOB_ELEMS), dtype=np.uint16)

    def key(self, layer, expert):
        return layer * NUM_EXPERTS + int(expert)

    def blob(self, key):
        return self.blobs[key]


def make_cache(tmp_path, capacity_mib=12, segments=4, reserve_mib=4.0):
    gpu = EmulatedGpu(tmp_path / "gpu0", capacity_mib=capacity_mib)
    arena = HostArena(BLOB_ELEMS * 2, np.uint16, [2 * MIB] * segments, gpu=gpu)
    arena.grow()
    return ExpertCache(FakeStore(), arena, startup_reserve_mib=reserve_mib, min_slots=2), gpu


def test_hits_misses_and_lru_eviction_order(tmp_path):
    cache, _ = make_cache(tmp_path, segments=1)  # 4 slots
    slots, ready = cache.acquire(0, [0, 1, 2, 3])
    assert list(slots) == [0, 1, 2, 3] and ready.all() and cache.misses == 4
    cache.acquire(0, [0])  # touch expert 0: expert 1 is now the oldest
    slots, _ = cache.acquire(1, [5])
    assert slots[0] == 1 and cache.key_slot.get(1) is None  # (0, 1) was evicted
    slots, _ = cache.acquire(0, [2, 4])  # 2 hits, 4 misses and must not evict 2 (pinned)
    assert cache.slot_key[slots[0]] == 2 and cache.slot_key[slots[1]] == 4
    assert (cache.hits, cache.misses, cache.h2d_bytes) == (2, 6, 6 * BLOB_ELEMS * 2)


def test_shrink_releases_whole_segments_to_the_ledger_and_bare_regrows(tmp_path):
    cache, gpu = make_cache(tmp_path)  # 8 MiB mapped of 12: 4 MiB free
    cache.acquire(0, list(range(6)))
    cache.release()
    report = cache.resize(5.0)  # 1 MiB short: still a whole 2 MiB segment goes
    assert report["free_mib"] == 6.0 and report["expert_slots"] == 12 and report["expert_cache_mib"] == 6.0
    other = EmulatedGpu(tmp_path / "gpu0")
    other.allocate(6 * MIB, "vision")
    with pytest.raises(MemoryError):
        other.allocate(1, "more")
    other.release(6 * MIB, "vision")
    assert cache.resize(None)["expert_cache_mib"] == 8.0
    assert gpu.memory_info()[0] == 4 * MIB


def test_a_shrink_keeps_the_hottest_experts_moving_them_out_of_the_tail(tmp_path):
    """The tail's experts move down in place of weaker ones (or into free slots) before their
    segments go: the hot set survives with its bytes, and the table points at the new slots."""
    cache, _ = make_cache(tmp_path, segments=4, capacity_mib=12)  # 16 slots, 4 MiB free
    keys = list(range(16))
    for key in keys:  # slot == key
        cache._assign(cache.free.pop(), key)
        cache.arena.write(cache.key_slot[key], cache.store.blob(key))
    hot = [12, 13, 14]  # in the last segment (slots 12-15); 15 stays cold
    for _ in range(3):
        cache.policy.observe(np.array(hot + list(range(8)), np.int64))  # 8-11 and 15: cold
    cache.resize(6.0)  # 2 MiB short: the last segment goes
    assert cache.num_slots == 12 and cache.last_resize["moved"] == 3
    assert set(cache.key_slot) == set(range(8)) | set(hot) | {11}  # the coldest below (8-10, oldest first) made room
    for key in hot:
        slot = cache.key_slot[key]
        assert slot < 12 and cache.placement.reshape(-1)[key] == slot and cache.slot_key[slot] == key
        assert (cache.arena.read(slot) == cache.store.blob(key)).all()
    assert not cache.free  # and 15 left with its segment


def test_grow_only_while_the_reserve_allows(tmp_path):
    cache, _ = make_cache(tmp_path)
    cache.resize(9.0)  # needs 5 MiB more: 3 segments go, 2 MiB mapped
    assert cache.report()["expert_cache_mib"] == 2.0
    report = cache.resize(7.0)  # 10 MiB free, 7 reserved: 3 spare, so one 2 MiB segment comes back
    assert (report["expert_cache_mib"], report["free_mib"]) == (4.0, 8.0)
    assert cache.resize(7.0)["expert_cache_mib"] == 4.0  # 1 MiB spare: less than a segment


def test_decode_steps_read_misses_in_place_and_admit_what_the_policy_keeps(tmp_path):
    cache, _ = make_cache(tmp_path, segments=1)  # 4 slots, freq policy
    cache.max_admissions = 4
    table = cache.device_placement(cache_ops())
    assert (table == np.array([[host_placement(r * NUM_EXPERTS + e) for e in range(NUM_EXPERTS)]
                               for r in range(NUM_LAYERS)])).all()  # nothing resident: all on the host
    step = np.zeros((NUM_LAYERS, 1, 2), np.int32)
    step[:, 0] = [0, 1]
    cache.observe(step)  # 6 distinct misses, read in place; 4 admitted into the free slots
    assert (cache.hits, cache.misses) == (0, 6) and len(cache.key_slot) == 4
    for key, slot in cache.key_slot.items():
        assert cache.placement.reshape(-1)[key] == slot
    cache.observe(step)
    cache.observe(step)
    hot = set(cache.key_slot)
    step[:, 0] = [4, 5]
    cache.observe(step)  # one-off experts: weaker than the hot residents, so none is admitted
    assert set(cache.key_slot) == hot and cache.hits == 8


def cache_ops():
    from moebus.cuda.backends.cpu import CpuBackend

    return CpuBackend()


def test_default_policy_keeps_at_least_the_cache_fraction_at_batch_8():
    from moebus.bench.cache import replay, synthetic_trace

    trace = synthetic_trace(60, 3, 32, 8, 4, repeat=0.28, recent=0.22, seed=3)
    for fraction in (0.25, 0.5):
        assert replay(trace, 32, fraction, "freq")["hit_rate"] >= fraction
        assert replay(trace, 32, fraction, "freq")["hit_rate"] >= replay(trace, 32, fraction, "lru")["hit_rate"]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        import tempfile
        from pathlib import Path

        self.tmp = Path(tempfile.mkdtemp())
        self.cache, self.gpu = make_cache(self.tmp)
        self.startup_bytes = self.cache.arena.mapped_bytes
        self.last_group: list[tuple[int, int]] = []

    @rule(layer=st.integers(0, NUM_LAYERS - 1), experts=st.sets(st.integers(0, NUM_EXPERTS - 1), min_size=1))
    def acquire(self, layer, experts):
        experts = sorted(experts)[: self.cache.num_slots]
        slots, ready = self.cache.acquire(layer, experts)
        assert ready.all()
        for e, s in zip(experts, slots):  # every pinned expert of the group is where it was said to be
            assert self.cache.slot_key[s] == self.cache.store.key(layer, e)
            assert s in self.cache.pinned
        self.last_group = [(self.cache.store.key(layer, e), s) for e, s in zip(experts, slots)]

    @rule()
    def release(self):
        self.cache.release()

    @precondition(lambda self: not self.cache.pinned)
    @rule(picks=st.lists(st.lists(st.permutations(range(NUM_EXPERTS)), min_size=1, max_size=2),
                         min_size=NUM_LAYERS, max_size=NUM_LAYERS))
    def observe(self, picks):
        # a routed decode step: per layer row, 1-2 tokens with 2 distinct experts each
        tokens = min(len(p) for p in picks)
        chosen = np.array([[perm[:2] for perm in p[:tokens]] for p in picks], np.int32)
        before = self.cache.hits + self.cache.misses
        self.cache.observe(chosen)
        distinct = len({(r, int(e)) for r in range(NUM_LAYERS) for e in chosen[r].reshape(-1)})
        assert self.cache.hits + self.cache.misses == before + distinct

    @precondition(lambda self: not self.cache.pinned and self.cache.loaned_from is None)
    @rule(num_bytes=st.integers(0, 8 * MIB))
    def loan(self, num_bytes):
        lo, hi = self.cache.lend(num_bytes)
        assert self.cache.num_slots == lo >= self.cache.min_slots or lo == hi
        assert not any(self.cache.slot_key[s] != EMPTY for s in range(lo, hi))  # lent slots hold no expert
        self.cache.end_loan()

    @precondition(lambda self: not self.cache.pinned)
    @rule(reserve=st.floats(0, 14))
    def resize(self, reserve):
        report = self.cache.resize(reserve)
        free = self.gpu.memory_info()[0]
        if free < reserve * MIB:  # could not free enough: only because the minimum was reached
            assert self.cache.arena.slots_after_shrink(1) < self.cache.min_slots or not self.cache.arena.mapped
        assert report["expert_slots"] == self.cache.num_slots

    @precondition(lambda self: not self.cache.pinned)
    @rule()
    def bare(self):
        self.cache.resize(None)
        assert self.cache.arena.mapped_bytes == self.startup_bytes

    @invariant()
    def mapped_never_exceeds_startup(self):
        assert self.cache.arena.mapped_bytes <= self.startup_bytes
        assert self.gpu.held("expert-cache") == self.cache.arena.mapped_bytes

    @invariant()
    def tables_are_a_bijection_within_mapped_slots(self):
        c = self.cache
        resident = np.nonzero(c.slot_key != EMPTY)[0]
        assert len(resident) == len(c.key_slot)
        for slot in resident:
            assert slot < c.num_slots and c.key_slot[int(c.slot_key[slot])] == slot
        assert set(c.free).isdisjoint(set(resident.tolist())) and all(s < c.num_slots for s in c.free)

    @invariant()
    def resident_bytes_equal_host_copies(self):
        c = self.cache
        for key, slot in c.key_slot.items():
            assert np.array_equal(c.arena.array[slot], c.store.blob(key))

    @invariant()
    def placement_points_only_at_slots_that_hold_the_expert(self):
        c = self.cache
        flat = c.placement.reshape(-1)
        for key in range(len(flat)):
            if key in c.key_slot and key not in c.pending:
                assert flat[key] == c.key_slot[key]
            else:
                assert flat[key] == host_placement(key)
        assert all(flat[k] < c.num_slots for k in range(len(flat)) if flat[k] >= 0)

    @invariant()
    def pinned_experts_stay_resident(self):
        for key, slot in self.last_group:
            if slot in self.cache.pinned:
                assert self.cache.slot_key[slot] == key


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_the_tail_walks_agree_with_the_sums_they_replace():
    """tail_to_release and slots_after_shrink walk only the segments they take (a 6 GiB cache has
    ~3000 of 2 MiB; summing them all per segment cost ~50 ms per worker INFO): the same answers as
    the sums over the kept head, on random segment lists, slot sizes and floors."""
    import random

    class Bare(Arena):  # segments as bookkeeping only: byte sizes too small for pages
        def __init__(self, slot_bytes, segments):
            super().__init__(slot_bytes, np.uint8, segments)

        def _map(self, offset, size):
            pass

        def _unmap(self, offset, size):
            pass

    def slots_kept(arena, n):
        return min(sum(arena.mapped[: max(len(arena.mapped) - n, 0)]) // arena.slot_bytes, arena.max_slots)

    rng = random.Random(0)
    for _ in range(500):
        segments = [rng.choice([2, 4, 6]) for _ in range(rng.randint(0, 10))] + [rng.choice([1, 2])]
        arena = Bare(rng.randint(1, 9), segments)
        arena.grow(rng.randint(0, len(segments)))
        floor, wanted = rng.randint(0, 6), rng.randint(0, 40)
        every = 0
        while every < len(arena.mapped) and slots_kept(arena, every + 1) >= floor:
            every += 1
        assert arena.tail_to_release(None, floor) == (every, sum(arena.mapped[len(arena.mapped) - every:]))
        count, freed = 0, 0
        while freed < wanted and count < len(arena.mapped) and slots_kept(arena, count + 1) >= floor:
            count, freed = count + 1, freed + arena.mapped[-count - 1]
        assert arena.tail_to_release(wanted, floor) == (count, freed)
        assert [arena.slots_after_shrink(n) for n in range(len(arena.mapped) + 2)] == \
            [slots_kept(arena, n) for n in range(len(arena.mapped) + 2)]
        released = arena.shrink(count)
        assert released == count and arena.mapped_bytes == sum(arena.mapped)


@pytest.mark.parametrize("policy", ["freq", "lru"])
def test_a_groups_misses_evict_what_one_victim_at_a_time_would(tmp_path, policy):
    """acquire() picks all of a group's victims by one sort (weakest_first): the same keys leave, and
    the same slots take the misses, as asking the policy for one victim per miss (the scan it
    replaced), and never a slot of the group's own hits."""
    from moebus.workers.eviction import make_policy

    def fill(cache):
        cache.policy = make_policy(policy, NUM_LAYERS * NUM_EXPERTS)
        for layer, experts in ((0, range(6)), (2, range(3)), (1, range(3))):  # 12 keys in 12 slots
            cache.acquire(layer, list(experts))
            cache.release()
        for key in np.random.default_rng(3).integers(0, 18, size=60):
            if int(key) in cache.key_slot:
                cache.policy.touch(int(key))
        return cache

    grouped = fill(make_cache(tmp_path / "a", segments=3)[0])
    scanned = fill(make_cache(tmp_path / "b", segments=3)[0])
    assert not grouped.free and len(grouped.key_slot) == 12
    group = list(range(NUM_EXPERTS))  # layer 1: experts 0-2 hit (pinned), 3-5 miss with no free slot
    slots, ready = grouped.acquire(1, group)
    hits = [scanned.store.key(1, e) for e in group[:3]]
    scanned.pinned = {scanned.key_slot[k] for k in hits}
    for key in hits:
        scanned.policy.touch(key)
    expected = []
    for _ in group[3:]:  # the old path: one scan a miss, each new key pinned as it lands
        key = scanned.policy.victim(lambda k: scanned.key_slot[k] not in scanned.pinned)
        slot = scanned.key_slot[key]
        scanned._evict(slot)
        scanned.pinned.add(slot)
        expected.append((key, slot))
    assert [int(s) for s in slots[3:]] == [slot for _, slot in expected]
    assert all(k not in grouped.key_slot for k, _ in expected)
    assert all(grouped.store.key(1, e) in grouped.key_slot for e in group)
