import numpy as np
import pytest

from moebus.cuda.kernels.moe import combine_cuda, combine_ref, expert_ffn_ref, topk_softmax_cuda, topk_softmax_ref
from moebus.cuda.kernels import moe_ffn
from moebus.cuda.kernels.moe_ffn import expert_ffn_cuda
from tests.cuda.conftest import STORAGES, device, poisoned, stored

HIDDEN, INTER = 16, 8


@pytest.mark.parametrize("num_experts, top_k, normalize", [(8, 2, True), (40, 5, False)])
def test_topk_softmax_matches_ref_with_ties_to_the_lower_id(rng, num_experts, top_k, normalize):
    logits = rng.standard_normal((3, num_experts), dtype=np.float32) * 2
    logits[0, [2, 6]] = logits[0].max() + 1  # a tie at the top
    logits[1, num_experts - 1] = logits[1].max() + 1  # the best expert in the last lane's second slot
    ids, weights = poisoned((3, top_k), np.int32), poisoned((3, top_k))
    topk_softmax_cuda(device(logits), top_k, normalize, ids, weights)
    ref_ids, ref_weights = topk_softmax_ref(logits, top_k, normalize)
    np.testing.assert_array_equal(ids.copy_to_host(), ref_ids)
    np.testing.assert_allclose(weights.copy_to_host(), ref_weights, rtol=1e-5)


def test_combine_matches_ref(rng):
    y = rng.standard_normal((6, 10), dtype=np.float32)
    weights = rng.random((3, 2), dtype=np.float32)
    out = poisoned((3, 10))
    combine_cuda(device(y), device(weights), out)
    np.testing.assert_allclose(out.copy_to_host(), combine_ref(y, weights), rtol=1e-5, atol=1e-6)


def _arena(rng, storage, num_slots=4):
    blobs = rng.standard_normal((num_slots, 3 * INTER * HIDDEN), dtype=np.float32) * 0.3
    return stored(blobs, storage)


def _ffn(x, table, arena, out):
    token, slot, pair = (np.ascontiguousarray(c, dtype=np.int32) for c in table)
    expert_ffn_cuda(device(x), device(token), device(slot), device(pair), arena, HIDDEN, INTER, out,
                    poisoned((len(pair), INTER)))


@pytest.mark.parametrize("storage", STORAGES)
def test_expert_ffn_hits_then_misses_into_one_output(rng, storage):
    # 2 tokens x top-2 = 4 pairs; slot 1 serves both tokens (one run of two pairs), pair 3 is a
    # "miss" computed by a second call; no pair is left unwritten
    x = rng.standard_normal((2, HIDDEN), dtype=np.float32)
    arena = _arena(rng, storage)
    hits = [(0, 1, 0), (1, 1, 2), (0, 3, 1)]  # (token, slot, pair), sorted by slot as the stage does
    misses = [(1, 0, 3)]
    out, expected = poisoned((4, HIDDEN)), np.full((4, HIDDEN), np.nan, np.float32)
    dev_arena = device(arena)
    for part in (hits, misses):
        _ffn(x, np.array(part).T, dev_arena, out)
        expert_ffn_ref(x, *np.array(part, np.int32).T, arena, HIDDEN, INTER, expected)
    np.testing.assert_allclose(out.copy_to_host(), expected, rtol=1e-5, atol=1e-6)


def test_expert_ffn_result_depends_neither_on_the_slot_nor_the_other_pairs(rng):
    x = rng.standard_normal((2, HIDDEN), dtype=np.float32)
    arena = _arena(rng, "bf16")
    arena[2] = arena[0]  # the same expert in two slots
    dev_arena = device(arena)
    together, alone = poisoned((2, HIDDEN)), poisoned((2, HIDDEN))
    _ffn(x, np.array([(0, 0, 0), (1, 0, 1)]).T, dev_arena, together)  # one run of two pairs
    _ffn(x, np.array([(1, 2, 1)]).T, dev_arena, alone)
    np.testing.assert_array_equal(alone.copy_to_host()[1], together.copy_to_host()[1])


def test_expert_ffn_in_several_launches_keeps_runs_whole(rng, monkeypatch):
    monkeypatch.setattr(moe_ffn, "MAX_GRID_Y", 3)  # chunk 2: launches of 2 pairs
    x = rng.standard_normal((2, HIDDEN), dtype=np.float32)
    arena = _arena(rng, "f32")
    pairs = [(0, 0, 0), (1, 0, 2), (0, 1, 1), (1, 3, 3)]
    out, expected = poisoned((4, HIDDEN)), np.zeros((4, HIDDEN), np.float32)
    _ffn(x, np.array(pairs).T, device(arena), out)
    expert_ffn_ref(x, *np.array(pairs, np.int32).T, arena, HIDDEN, INTER, expected)
    np.testing.assert_allclose(out.copy_to_host(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("short_rows, long_rows", [(2, 4), (3, 2)])
def test_expert_ffn_with_several_down_rows_a_warp(rng, monkeypatch, short_rows, long_rows):
    # the down kernel's other work shapes (moe_ffn.down_shape): runs of 1 and of 3 pairs, rows of the
    # output not a multiple of the rows a warp takes
    monkeypatch.setattr(moe_ffn, "DOWN_ROWS_SHORT", short_rows)
    monkeypatch.setattr(moe_ffn, "DOWN_ROWS_LONG", long_rows)
    x = rng.standard_normal((3, HIDDEN), dtype=np.float32)
    arena = _arena(rng, "bf16")
    one_token = [(0, 2, 0), (0, 0, 1)]  # one token a pass: short runs
    three_tokens = [(0, 1, 0), (1, 1, 2), (2, 1, 4), (0, 3, 1), (1, 0, 3), (2, 2, 5)]
    for xs, pairs in ((x[:1], one_token), (x, three_tokens)):
        out, expected = poisoned((6, HIDDEN)), np.full((6, HIDDEN), np.nan, np.float32)
        _ffn(xs, np.array(pairs).T, device(arena), out)
        expert_ffn_ref(xs, *np.array(pairs, np.int32).T, arena, HIDDEN, INTER, expected)
        np.testing.assert_allclose(out.copy_to_host(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [2, 3])
def test_expert_ffn_with_several_gate_up_rows_a_warp_gives_the_same_bits(rng, monkeypatch, rows):
    # moe_ffn.gate_up_shape with short runs (one token a pass): a warp takes `rows` rows of I (8: not
    # always a multiple), each lane's words in the same order, so the same bits as one row a warp
    x = rng.standard_normal((1, HIDDEN), dtype=np.float32)
    arena = _arena(rng, "bf16")
    pairs = np.array([(0, 2, 0), (0, 0, 1), (0, 3, 2)]).T
    results = []
    for gate_up_rows in (1, rows):
        monkeypatch.setattr(moe_ffn, "GATE_UP_ROWS_SHORT", gate_up_rows)
        out = poisoned((3, HIDDEN))
        _ffn(x, pairs, device(arena), out)
        results.append(out.copy_to_host())
    expected = np.full((3, HIDDEN), np.nan, np.float32)
    expert_ffn_ref(x, *pairs.astype(np.int32), arena, HIDDEN, INTER, expected)
    np.testing.assert_allclose(results[1], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("blocks, prefetch", [(1, True), (1, False), (2, True)])
def test_down_with_fewer_blocks_and_the_next_groups_prefetched_gives_the_same_bits(rng, monkeypatch, blocks,
                                                                                   prefetch):
    # moe_ffn.DOWN_BLOCKS_SHORT / DOWN_PREFETCH_NEXT (short runs: one token a pass): each warp takes several
    # row groups in turn (HIDDEN 16 = 8 groups of 2 rows; 1 block of 4 warps: 2 groups a warp), asking L2
    # for the next one's rows first; a host-store entry (negative) is not prefetched; same bits as before
    x = rng.standard_normal((1, HIDDEN), dtype=np.float32)
    arena = _arena(rng, "bf16")
    store = _arena(rng, "bf16", num_slots=2)
    token, slot, pair = (np.array(c, np.int32) for c in ([0, 0, 0], [2, -2, 3], [0, 1, 2]))
    results = []
    for cap, ahead in ((0, False), (blocks, prefetch)):
        monkeypatch.setattr(moe_ffn, "DOWN_BLOCKS_SHORT", cap)
        monkeypatch.setattr(moe_ffn, "DOWN_PREFETCH_NEXT", ahead)
        out = poisoned((3, HIDDEN))
        expert_ffn_cuda(device(x), device(token), device(slot), device(pair), device(arena), HIDDEN, INTER, out,
                        poisoned((3, INTER)), store=device(store))
        results.append(out.copy_to_host())
    expected = np.full((3, HIDDEN), np.nan, np.float32)
    hits = slot >= 0
    expert_ffn_ref(x, token[hits], slot[hits], pair[hits], arena, HIDDEN, INTER, expected)
    expert_ffn_ref(x, token[~hits], -1 - slot[~hits], pair[~hits], store, HIDDEN, INTER, expected)
    np.testing.assert_allclose(results[1], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("storage", ["bf16", "f16"])
def test_expert_ffn_streaming_weight_loads_give_the_same_bits(rng, monkeypatch, storage):
    # evict-first loads (moe_ffn.STREAM_WEIGHTS, loads.STREAMING) read the same words
    x = rng.standard_normal((2, HIDDEN), dtype=np.float32)
    dev_arena = device(_arena(rng, storage))
    pairs = np.array([(0, 1, 0), (1, 1, 2), (0, 3, 1), (1, 0, 3)]).T
    results = []
    for streaming in (False, True):
        monkeypatch.setattr(moe_ffn, "STREAM_WEIGHTS", streaming)
        out = poisoned((4, HIDDEN))
        _ffn(x, pairs, dev_arena, out)
        results.append(out.copy_to_host())
    np.testing.assert_array_equal(results[0], results[1])
