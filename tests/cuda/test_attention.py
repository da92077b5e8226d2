import numpy as np
import pytest

from moebus.cuda.dtypes import bf16_to_f32, f32_to_bf16
from moebus.cuda.kernels.attention import (SPLIT_POSITIONS, attention_cuda, attention_ref, kv_store_cuda, kv_store_ref,
                                           max_splits)
from moebus.cuda.kernels.attention_decode import layout
from tests.cuda.conftest import device, poisoned

SLOTS, HEAD_DIM = 3, 8


def _cache(rng, kv_heads, context, kv_dtype="fp32", head_dim=HEAD_DIM):
    values = rng.standard_normal((SLOTS, kv_heads, context, head_dim), dtype=np.float32)
    return f32_to_bf16(values) if kv_dtype == "bf16" else values


def _attend(q, k_cache, v_cache, slots, positions, window=0):
    out = poisoned(q.shape)
    attention_cuda(device(q), device(k_cache), device(v_cache), device(slots), device(positions), 0.35, window, out)
    return out.copy_to_host()


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_kv_store_writes_each_token_at_its_slot_and_position(rng, kv_dtype):
    k_cache, v_cache = _cache(rng, 2, 16, kv_dtype), _cache(rng, 2, 16, kv_dtype)
    k, v = (rng.standard_normal((3, 2, HEAD_DIM), dtype=np.float32) for _ in range(2))
    slots, positions = np.array([2, 0, 2], np.int32), np.array([5, 0, 6], np.int32)
    dk, dv = device(k_cache), device(v_cache)
    kv_store_cuda(dk, dv, device(k), device(v), device(slots), device(positions))
    kv_store_ref(k_cache, v_cache, k, v, slots, positions)
    np.testing.assert_array_equal(dk.copy_to_host(), k_cache)
    np.testing.assert_array_equal(dv.copy_to_host(), v_cache)


def test_bf16_cache_holds_the_values_rounded_to_nearest_even():
    k_cache = np.zeros((1, 1, 2, 4), np.uint16)
    k = np.array([[[1.0, 1.00390625, 1.01171875, -3.3]]], np.float32)  # halfway cases round to even
    kv_store_ref(k_cache, k_cache.copy(), k, k, np.array([0], np.int32), np.array([1], np.int32))
    np.testing.assert_array_equal(bf16_to_f32(k_cache[0, 0, 1]), bf16_to_f32(f32_to_bf16(k[0, 0])))
    assert bf16_to_f32(k_cache[0, 0, 1])[1] == 1.0 and bf16_to_f32(k_cache[0, 0, 1])[2] == 1.015625


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, window", [(4, 2, 0), (2, 2, 0), (4, 1, 5), (6, 2, 0)])
def test_attention_prefill_and_decode_mixed(rng, heads, kv_heads, window, kv_dtype):
    # slot 0: a 3-token prefill chunk; slot 2: decode past the first split's positions
    context = SPLIT_POSITIONS + 16
    k_cache, v_cache = _cache(rng, kv_heads, context, kv_dtype), _cache(rng, kv_heads, context, kv_dtype)
    slots = np.array([0, 0, 0, 2], np.int32)
    positions = np.array([4, 5, 6, SPLIT_POSITIONS + 9], np.int32)
    q = rng.standard_normal((4, heads, HEAD_DIM), dtype=np.float32)
    expected = attention_ref(q, k_cache, v_cache, slots, positions, 0.35, window)
    np.testing.assert_allclose(_attend(q, k_cache, v_cache, slots, positions, window), expected, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_attention_long_context_runs_in_splits(rng, kv_dtype):
    # positions past SPLIT_POSITIONS: two and three splits, merged; one short token alongside
    context = SPLIT_POSITIONS * 3 + 8
    assert max_splits(context) == 4
    k_cache, v_cache = _cache(rng, 1, context, kv_dtype), _cache(rng, 1, context, kv_dtype)
    slots = np.array([1, 0, 2], np.int32)
    positions = np.array([SPLIT_POSITIONS * 2 + 3, context - 1, 2], np.int32)
    q = rng.standard_normal((3, 2, HEAD_DIM), dtype=np.float32)
    expected = attention_ref(q, k_cache, v_cache, slots, positions, 0.35)
    np.testing.assert_allclose(_attend(q, k_cache, v_cache, slots, positions), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim, group", [(128, 8), (64, 4), (16, 1), (24, 2)])
def test_attention_at_real_head_dims(rng, head_dim, group):
    # the layouts of real models: a row over 16 lanes (Qwen3-30B-A3B: hd 128, 8 heads per kv head)
    k_cache, v_cache = (_cache(rng, 1, 40, "bf16", head_dim) for _ in range(2))
    slots, positions = np.array([0, 1], np.int32), np.array([39, 17], np.int32)
    q = rng.standard_normal((2, group, head_dim), dtype=np.float32)
    expected = attention_ref(q, k_cache, v_cache, slots, positions, 0.35)
    np.testing.assert_allclose(_attend(q, k_cache, v_cache, slots, positions), expected, rtol=1e-5, atol=1e-5)


def test_layout_of_qwen3_30b_a3b():
    lanes, quads, heads, head_sets, _ = layout(128, 8)
    assert (lanes, quads, heads, head_sets) == (16, 2, 4, 2)


def test_attention_token_does_not_depend_on_the_batch(rng):
    k_cache, v_cache = _cache(rng, 1, 8), _cache(rng, 1, 8)
    q = rng.standard_normal((2, 2, HEAD_DIM), dtype=np.float32)
    together = _attend(q, k_cache, v_cache, np.array([1, 0], np.int32), np.array([3, 7], np.int32))
    alone = _attend(q[1:], k_cache, v_cache, np.array([0], np.int32), np.array([7], np.int32))
    np.testing.assert_array_equal(alone[0], together[1])


def test_attention_rejects_a_head_dim_not_in_fours(rng):
    k_cache = _cache(rng, 1, 8, head_dim=6)
    with pytest.raises(ValueError, match="head_dim 6"):
        _attend(rng.standard_normal((1, 1, 6), dtype=np.float32), k_cache, k_cache, np.array([0], np.int32),
                np.array([3], np.int32))


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2), (2, 1)])
def test_splits_merged_by_their_last_block_give_merge_splits_bits(rng, kv_dtype, heads, kv_heads):
    # 1, 2, 3 and 6 splits (6 > MERGE_SPLITS: the peaks in a pass of their own); the counters back at 0
    context = SPLIT_POSITIONS * 6
    k_cache, v_cache = _cache(rng, kv_heads, context, kv_dtype), _cache(rng, kv_heads, context, kv_dtype)
    slots = np.array([1, 0, 2, 1], np.int32)
    positions = np.array([5, SPLIT_POSITIONS + 3, SPLIT_POSITIONS * 2 + 7, context - 1], np.int32)
    q = rng.standard_normal((4, heads, HEAD_DIM), dtype=np.float32)
    args = (device(q), device(k_cache), device(v_cache), device(slots), device(positions), 0.35, 0)
    apart, merged = poisoned(q.shape), poisoned(q.shape)
    attention_cuda(*args, apart)
    done = device(np.zeros(4 * kv_heads + 3, np.int32))
    for _ in range(2):  # a second launch finds the counters at 0, as a replayed graph does
        attention_cuda(*args, merged, done=done)
        np.testing.assert_array_equal(merged.copy_to_host(), apart.copy_to_host())
        np.testing.assert_array_equal(done.copy_to_host(), 0)


def test_too_few_counters_merge_apart(rng):
    k_cache, v_cache = _cache(rng, 2, 16), _cache(rng, 2, 16)
    q = rng.standard_normal((2, 4, HEAD_DIM), dtype=np.float32)
    slots, positions = np.array([0, 1], np.int32), np.array([9, 15], np.int32)
    done = device(np.full(3, 7, np.int32))  # 2 tokens x 2 kv heads need 4: not used
    out = poisoned(q.shape)
    attention_cuda(device(q), device(k_cache), device(v_cache), device(slots), device(positions), 0.35, 0, out,
                   done=done)
    np.testing.assert_array_equal(done.copy_to_host(), 7)
    np.testing.assert_allclose(out.copy_to_host(), attention_ref(q, k_cache, v_cache, slots, positions, 0.35),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, window", [(8, 2, 0), (4, 1, 5)])
def test_decode_settings_against_the_reference(rng, monkeypatch, kv_dtype, heads, kv_heads, window):
    """attention_decode's tunables (FAST_EXP: softmax in base 2; one head set of all the group's heads;
    more rows ahead; L2 prefetches ahead of the loads) give attention_ref's result within the tests' tolerance, split apart and merged
    by the last block alike."""
    from moebus.cuda.kernels import attention_decode

    context = SPLIT_POSITIONS * 3 + 5
    k_cache, v_cache = _cache(rng, kv_heads, context, kv_dtype), _cache(rng, kv_heads, context, kv_dtype)
    slots = np.array([1, 0, 2], np.int32)
    positions = np.array([3, SPLIT_POSITIONS + 6, context - 1], np.int32)
    q = rng.standard_normal((3, heads, HEAD_DIM), dtype=np.float32)
    expected = attention_ref(q, k_cache, v_cache, slots, positions, 0.35, window)
    monkeypatch.setattr(attention_decode, "FAST_EXP", True)
    monkeypatch.setattr(attention_decode, "MAX_HEADS_PER_WARP", 8)
    monkeypatch.setattr(attention_decode, "ROWS_AHEAD", 4)
    monkeypatch.setattr(attention_decode, "L2_AHEAD", 16)
    np.testing.assert_allclose(_attend(q, k_cache, v_cache, slots, positions, window), expected, rtol=1e-5, atol=1e-5)
    merged = poisoned(q.shape)
    attention_cuda(device(q), device(k_cache), device(v_cache), device(slots), device(positions), 0.35, window, merged,
                   done=device(np.zeros(3 * kv_heads, np.int32)))
    np.testing.assert_allclose(merged.copy_to_host(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("head_dim, heads, kv_heads, max_heads", [(64, 8, 2, 4), (32, 8, 1, 8), (64, 4, 2, 2)])
def test_owner_softmax_against_the_reference(rng, monkeypatch, kv_dtype, head_dim, heads, kv_heads, max_heads):
    """OWNER_SOFTMAX (a row's scores reduce-scattered, each lane one head's online softmax) gives
    attention_ref's result, with FAST_EXP and without, merged by the last block."""
    from moebus.cuda.kernels import attention_decode

    context = SPLIT_POSITIONS * 2 + 7
    shape = (SLOTS, kv_heads, context, head_dim)
    k_cache, v_cache = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    if kv_dtype == "bf16":
        k_cache, v_cache = f32_to_bf16(k_cache), f32_to_bf16(v_cache)
    slots = np.array([2, 0], np.int32)
    positions = np.array([4, context - 1], np.int32)
    q = rng.standard_normal((2, heads, head_dim), dtype=np.float32)
    expected = attention_ref(q, k_cache, v_cache, slots, positions, 0.35)
    monkeypatch.setattr(attention_decode, "OWNER_SOFTMAX", True)
    monkeypatch.setattr(attention_decode, "MAX_HEADS_PER_WARP", max_heads)
    for fast in (False, True):
        monkeypatch.setattr(attention_decode, "FAST_EXP", fast)
        out = poisoned(q.shape)
        attention_cuda(device(q), device(k_cache), device(v_cache), device(slots), device(positions), 0.35, 0, out,
                       done=device(np.zeros(2 * kv_heads, np.int32)))
        np.testing.assert_allclose(out.copy_to_host(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype, window", [("fp32", 0), ("bf16", 150)])  # each dtype and each window once
def test_more_decode_splits_than_the_chunk_tiles_merged_in_the_block_and_apart(rng, monkeypatch, kv_dtype, window):
    """DECODE_SPLITS past MAX_SPLITS (a long context's decode in short splits: their weights' shared
    memory past a warp's lanes), ragged lengths, GQA, two tokens: attention_ref's result, and the last
    block's merge gives merge_splits' bits."""
    from moebus.cuda.kernels import attention_decode

    monkeypatch.setattr(attention_decode, "SPLIT_POSITIONS", 2)
    monkeypatch.setattr(attention_decode, "DECODE_SPLITS", 80)
    monkeypatch.setattr(attention_decode, "MERGE_SPLITS", 8)
    context = 200
    assert max_splits(context) == 80
    k_cache, v_cache = _cache(rng, 1, context, kv_dtype), _cache(rng, 1, context, kv_dtype)
    slots, positions = np.array([1, 0], np.int32), np.array([context - 1, 37], np.int32)  # 80 splits and 19
    q = rng.standard_normal((2, 4, HEAD_DIM), dtype=np.float32)
    expected = attention_ref(q, k_cache, v_cache, slots, positions, 0.35, window)
    apart, merged = poisoned(q.shape), poisoned(q.shape)
    args = (device(q), device(k_cache), device(v_cache), device(slots), device(positions), 0.35, window)
    attention_cuda(*args, apart)
    attention_cuda(*args, merged, done=device(np.zeros(2, np.int32)))
    np.testing.assert_allclose(apart.copy_to_host(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(merged.copy_to_host(), apart.copy_to_host())


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_the_wide_merges_give_the_serial_merges_bits(rng, monkeypatch, kv_dtype):
    """WIDE_MERGE (loads in flight, weights in shared memory) adds the same terms in the same order as
    the fourteenth session's merges: the same bits, in the block and apart."""
    from moebus.cuda.kernels import attention_decode

    context = SPLIT_POSITIONS * 6
    k_cache, v_cache = _cache(rng, 2, context, kv_dtype), _cache(rng, 2, context, kv_dtype)
    slots, positions = np.array([1, 0, 2], np.int32), np.array([SPLIT_POSITIONS + 3, context - 1, 9], np.int32)
    q = rng.standard_normal((3, 4, HEAD_DIM), dtype=np.float32)
    args = (device(q), device(k_cache), device(v_cache), device(slots), device(positions), 0.35, 0)
    outs = []
    for wide in (False, True):
        monkeypatch.setattr(attention_decode, "WIDE_MERGE", wide)
        for done in (None, device(np.zeros(6, np.int32))):
            out = poisoned(q.shape)
            attention_cuda(*args, out, done=done)
            outs.append(out.copy_to_host())
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
