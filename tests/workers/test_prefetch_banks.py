"""The prefetch's bank slots in the cache's bookkeeping (cpu arena, emulated GPU): never free, never
a preload's or an admission's; lent to a prefill group only when every other slot is pinned, and
back at release; kept by shrinks and loans; the prefetch's counters and wasted bytes."""
import numpy as np

from moebus.cuda.memory.arena import HostArena
from moebus.cuda.memory.ledger import MIB, EmulatedGpu
from moebus.workers.expert_cache import EMPTY, ExpertCache
from moebus.workers.prefetch import Prefetch
from tests.workers.test_expert_cache import BLOB_ELEMS, NUM_EXPERTS, NUM_LAYERS, FakeStore

BLOB_BYTES = BLOB_ELEMS * 2


def make_cache(tmp_path, segments=2, slots_per_layer=1):
    """4 slots a segment; the first 2 * slots_per_layer are the banks."""
    gpu = EmulatedGpu(tmp_path / "gpu0", capacity_mib=12)
    arena = HostArena(BLOB_BYTES, np.uint16, [2 * MIB] * segments, gpu=gpu)
    arena.grow()
    prefetch = Prefetch(slots_per_layer, NUM_LAYERS, NUM_EXPERTS, 2, BLOB_BYTES)
    return ExpertCache(FakeStore(), arena, min_slots=2 + prefetch.num_reserved, prefetch=prefetch)


def test_banks_are_never_free_nor_filled_by_a_preload_or_an_admission(tmp_path):
    cache = make_cache(tmp_path)  # 8 slots, banks 0 and 1
    assert sorted(cache.free) == [2, 3, 4, 5, 6, 7]
    assert cache.preload() == 6 and all(cache.slot_key[s] == EMPTY for s in (0, 1))
    cache.observe(np.array([[[0, 1]], [[2, 3]], [[4, 5]]], np.int32))  # misses: admissions evict, never bank
    assert all(cache.slot_key[s] == EMPTY for s in (0, 1)) and min(cache.key_slot.values()) >= 2


def test_a_prefill_group_borrows_a_bank_slot_only_when_every_other_is_pinned(tmp_path):
    cache = make_cache(tmp_path, segments=1)  # 4 slots: banks 0, 1 and two for the cache
    slots, _ = cache.acquire(0, [0, 1, 2])  # three experts pinned at once: one bank slot lent
    assert sorted(slots.tolist()) == [0, 2, 3]
    lent_key = int(cache.slot_key[0])
    assert lent_key in (0, 1, 2) and cache.placement.reshape(-1)[lent_key] == 0  # the kernels read it there
    cache.release()  # the bank comes back: its expert is read from the host store again
    assert all(cache.slot_key[s] == EMPTY for s in (0, 1)) and sorted(cache.key_slot.values()) == [2, 3]
    assert (cache.placement >= 2).sum() == 2 and (cache.placement[cache.placement >= 0] >= 2).all()


def test_shrinks_and_loans_keep_the_banks(tmp_path):
    cache = make_cache(tmp_path)  # min_slots 4: 2 banks + an expert group of 2
    cache.preload()
    cache.resize(12.0)  # a reserve of everything: down to the floor, the banks kept
    assert cache.num_slots == 4 and cache.num_reserved == 2
    lo, hi = cache.lend(10 * BLOB_BYTES)
    assert lo >= 4 and cache.num_slots >= 4
    cache.end_loan()


def test_prefetch_counters_and_wasted_bytes(tmp_path):
    cache = make_cache(tmp_path)
    chosen = np.array([[[0, 1]], [[2, 3]], [[4, 5]]], np.int32)  # (rows, T, A)
    keys = np.array([[-1], [1 * NUM_EXPERTS + 3], [2 * NUM_EXPERTS + 0]], np.int32)  # row 1 right, row 2 wrong
    before = cache.h2d_bytes
    cache.observe_prefetch(keys, chosen)
    stats = cache.stats()
    assert (stats["prefetched"], stats["prefetch_used"], stats["prefetch_wasted"]) == (2, 1, 1)
    assert stats["prefetch_wasted_bytes"] == BLOB_BYTES and cache.h2d_bytes - before == BLOB_BYTES


def test_decode_tiles_only_where_the_cache_holds_every_expert_besides_its_banks(tmp_path, monkeypatch):
    from moebus.workers import expert_cache

    partial = make_cache(tmp_path / "a", segments=2)  # 8 slots, 2 of them banks, for more keys
    assert partial.num_slots - partial.num_reserved < NUM_LAYERS * NUM_EXPERTS
    assert not partial.decode_tiles(8) and partial.decode_tiles(9)  # up to 8 tokens (the default) on GEMVs
    assert make_cache(tmp_path / "b", segments=5).decode_tiles(8)  # 20 slots: 2 banks + all 18 experts
    monkeypatch.setattr(expert_cache, "MISSES_IN_GEMVS_UP_TO", 0)
    assert partial.decode_tiles(1)
