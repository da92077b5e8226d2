import numpy as np
import pytest

from moebus.cuda.kernels.attention import (TILE, TILES_PER_SPLIT, attention_cuda, attention_ref, kv_store_cuda,
                                  kv_store_ref, max_splits)
from tests.cuda.conftest import device, poisoned

SLOTS, HEAD_DIM = 3, 8


def _cache(rng, kv_heads, context):
    return rng.standard_normal((SLOTS, kv_heads, context, HEAD_DIM), dtype=np.float32)


def _attend(q, k_cache, v_cache, slots, positions, window=0):
    out = poisoned(q.shape)
    attention_cuda(device(q), device(k_cache), device(v_cache), device(slots), device(positions), 0.35, window, out)
    return out.copy_to_host()


def test_kv_store_writes_each_token_at_its_slot_and_position(rng):
    k_cache, v_cache = _cache(rng, 2, 16), _cache(rng, 2, 16)
    k, v = (rng.standard_normal((3, 2, HEAD_DIM), dtype=np.float32) for _ in range(2))
    slots, positions = np.array([2, 0, 2], np.int32), np.array([5, 0, 6], np.int32)
    dk, dv = device(k_cache), device(v_cache)
    kv_store_cuda(dk, dv, device(k), device(v), device(slots), device(positions))
    kv_store_ref(k_cache, v_cache, k, v, slots, positions)
    np.testing.assert_array_equal(dk.copy_to_host(), k_cache)
    np.testing.assert_array_equal(dv.copy_to_host(), v_cache)


@pytest.mark.parametrize("heads, kv_heads, window", [(4, 2, 0), (2, 2, 0), (4, 1, 5)])
def test_attention_prefill_and_decode_mixed(rng, heads, kv_heads, window):
    # slot 0: a 3-token prefill chunk; slot 2: decode past the first tile (position >= TILE)
    context = TILE + 16
    k_cache, v_cache = _cache(rng, kv_heads, context), _cache(rng, kv_heads, context)
    slots = np.array([0, 0, 0, 2], np.int32)
    positions = np.array([4, 5, 6, TILE + 9], np.int32)
    q = rng.standard_normal((4, heads, HEAD_DIM), dtype=np.float32)
    expected = attention_ref(q, k_cache, v_cache, slots, positions, 0.35, window)
    np.testing.assert_allclose(_attend(q, k_cache, v_cache, slots, positions, window), expected, rtol=1e-5,
                               atol=1e-6)


def test_attention_long_context_runs_in_splits(rng):
    # positions past TILES_PER_SPLIT tiles: two and three splits, merged; one short token alongside
    context = TILE * TILES_PER_SPLIT * 2 + 8
    assert max_splits(context) == 3
    k_cache, v_cache = _cache(rng, 1, context), _cache(rng, 1, context)
    slots, positions = np.array([1, 0, 2], np.int32), np.array([TILE * TILES_PER_SPLIT + 3, context - 1, 2], np.int32)
    q = rng.standard_normal((3, 2, HEAD_DIM), dtype=np.float32)
    expected = attention_ref(q, k_cache, v_cache, slots, positions, 0.35)
    np.testing.assert_allclose(_attend(q, k_cache, v_cache, slots, positions), expected, rtol=1e-5, atol=1e-6)


def test_attention_token_does_not_depend_on_the_batch(rng):
    k_cache, v_cache = _cache(rng, 1, 8), _cache(rng, 1, 8)
    q = rng.standard_normal((2, 2, HEAD_DIM), dtype=np.float32)
    together = _attend(q, k_cache, v_cache, np.array([1, 0], np.int32), np.array([3, 7], np.int32))
    alone = _attend(q[1:], k_cache, v_cache, np.array([0], np.int32), np.array([7], np.int32))
    np.testing.assert_array_equal(alone[0], together[1])
