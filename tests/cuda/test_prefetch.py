"""The prefetch's kernels against their numpy references: the plan (which non-resident experts of the
next layer, in which order), the copy of host-store rows into bank slots, the remap of pairs."""
import numpy as np
import pytest

from moebus.cuda.kernels.prefetch import (copy_prefetch_cuda, copy_prefetch_ref, plan_from_logits_cuda,
                                          plan_from_logits_ref, plan_prefetch_cuda,
                                          plan_prefetch_ref, remap_placement_cuda, remap_placement_ref,
                                          remap_prefetched_cuda, remap_prefetched_ref)
from moebus.cuda.kernels.routing import host_placement
from tests.cuda.conftest import device, poisoned

EXPERTS = 6


def _table(resident: dict, rows=2):
    table = np.array([[host_placement(r * EXPERTS + e) for e in range(EXPERTS)] for r in range(rows)], np.int32)
    for (row, e), slot in resident.items():
        table[row, e] = slot
    return table


def test_plan_takes_non_resident_experts_most_tokens_first():
    ids = np.array([[3, 1, 0], [1, 5, 3], [2, 1, 4]], np.int32)  # 1: three tokens; 3: two; 0 2 4 5: one
    table = _table({(1, 3): 7})  # expert 3 of row 1 is resident
    keys = poisoned((4,), np.int32)
    plan_prefetch_cuda(device(ids), device(table), 1, keys)
    got = keys.copy_to_host()
    # 1 (3 votes), then one-vote experts by their best rank: 2 and 5 rank 0... 2 at 0, 5 at 1, 0 and 4 at 2
    assert got.tolist() == [1 * EXPERTS + 1, 1 * EXPERTS + 2, 1 * EXPERTS + 5, 1 * EXPERTS + 0]
    np.testing.assert_array_equal(got, plan_prefetch_ref(ids, table, 1, 4))


def test_plan_fills_the_rest_with_minus_one_and_matches_the_reference(rng):
    for trial in range(3):
        ids = np.stack([rng.permutation(EXPERTS)[:2] for _ in range(3)]).astype(np.int32)
        resident = {(0, int(e)): int(s) for s, e in enumerate(rng.permutation(EXPERTS)[:trial + 2])}
        table = _table(resident)
        keys = poisoned((5,), np.int32)
        plan_prefetch_cuda(device(ids), device(table), 0, keys)
        want = plan_prefetch_ref(ids, table, 0, 5)
        np.testing.assert_array_equal(keys.copy_to_host(), want)
        assert (want[(want >= 0).sum():] == -1).all()


@pytest.mark.parametrize("dtype, width", [(np.uint16, 24), (np.uint8, 13)])
def test_copy_brings_the_planned_rows_into_the_bank_slots(rng, dtype, width):
    store = rng.integers(0, 200, size=(8, width)).astype(dtype)
    arena = rng.integers(0, 200, size=(6, width)).astype(dtype)
    keys = np.array([5, -1, 2], np.int32)
    want = arena.copy()
    copy_prefetch_ref(keys, store, want, 3)
    got = device(arena)
    copy_prefetch_cuda(device(keys), device(store), got, 3)
    np.testing.assert_array_equal(got.copy_to_host(), want)
    np.testing.assert_array_equal(want[[3, 5]], store[[5, 2]])
    np.testing.assert_array_equal(want[4], arena[4])  # no key: the slot is left as it was


@pytest.mark.parametrize("blocks_per_slot, unroll", [(1, 16), (2, 3)])
def test_copy_at_other_blocks_and_words_in_flight_brings_the_same_rows(rng, monkeypatch, blocks_per_slot, unroll):
    from moebus.cuda.kernels import prefetch as kernels

    monkeypatch.setattr(kernels, "COPY_BLOCKS_PER_SLOT", blocks_per_slot)
    monkeypatch.setattr(kernels, "COPY_UNROLL", unroll)
    store = rng.integers(0, 1 << 15, size=(5, 200)).astype(np.uint16)  # 50 uint64 words a row
    arena = np.zeros((4, 200), np.uint16)
    keys = np.array([4, 0], np.int32)
    got = device(arena)
    copy_prefetch_cuda(device(keys), device(store), got, 2)
    np.testing.assert_array_equal(got.copy_to_host()[2:], store[[4, 0]])


def test_copy_refuses_slots_outside_the_arena():
    with pytest.raises(ValueError, match="outside"):
        copy_prefetch_cuda(device(np.zeros(3, np.int32)), device(np.zeros((4, 8), np.uint16)),
                           device(np.zeros((4, 8), np.uint16)), 2)


def test_remap_points_prefetched_misses_at_their_bank_slot():
    pair_slot = np.array([4, host_placement(9), host_placement(9), host_placement(2), 0, host_placement(7)], np.int32)
    keys = np.array([7, 9, -1], np.int32)
    got = device(pair_slot)
    remap_prefetched_cuda(got, device(keys), 10)
    assert got.copy_to_host().tolist() == [4, 11, 11, host_placement(2), 0, 10]
    np.testing.assert_array_equal(got.copy_to_host(), remap_prefetched_ref(pair_slot, keys, 10))


def test_remap_placement_copies_the_row_with_prefetched_experts_at_their_bank_slot():
    table = _table({(1, 0): 4, (1, 3): 5})  # row 1: experts 0 and 3 resident, the rest in the host store
    keys = np.array([1 * EXPERTS + 5, 1 * EXPERTS + 2, -1], np.int32)  # row 1's experts 5 and 2 prefetched
    out = device(np.full(EXPERTS, 99, np.int32))
    remap_placement_cuda(device(table), 1, device(keys), 10, out)
    assert out.copy_to_host().tolist() == [4, host_placement(7), 11, 5, host_placement(10), 10]
    np.testing.assert_array_equal(out.copy_to_host(), remap_placement_ref(table, 1, keys, 10))
    np.testing.assert_array_equal(table[1], _table({(1, 0): 4, (1, 3): 5})[1])  # the table itself unchanged


def test_plan_from_logits_ranks_each_tokens_top_experts_as_the_reference(rng):
    logits = rng.standard_normal((5, EXPERTS)).astype(np.float32)
    logits[0, 4] = logits[0, 1] = 9.0  # a tie at the top: the lower id ranks first
    table = _table({(0, 2): 3})
    for per_token, num_slots in ((2, 3), (1, 2), (3, 6)):
        keys = device(np.full(num_slots, 77, np.int32))
        plan_from_logits_cuda(device(logits), per_token, device(table), 0, keys)
        want = plan_from_logits_ref(logits, per_token, table, 0, num_slots)
        np.testing.assert_array_equal(keys.copy_to_host(), want)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :2]
    assert ids[0].tolist() == [1, 4]
    np.testing.assert_array_equal(plan_from_logits_ref(logits, 2, table, 0, 3), plan_prefetch_ref(ids, table, 0, 3))
