import numpy as np
import pytest

from moebus.cuda.kernels.linear import MAX_TOKENS, linear_cuda, linear_ref
from tests.cuda.conftest import STORAGES, device, nmse, poisoned, stored


def _run(x, weight):
    out = poisoned((x.shape[0], weight.shape[0]))
    linear_cuda(device(x), device(weight), out)
    return out.copy_to_host()


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("num_tokens, dim_in, dim_out", [(1, 40, 9), (3, 16, 6), (MAX_TOKENS + 3, 12, 5)])
def test_linear_matches_ref(rng, storage, num_tokens, dim_in, dim_out):
    # wide reads (dim_in % 4 == 0); MAX_TOKENS + 3 runs two token chunks, the second one partial
    x = rng.standard_normal((num_tokens, dim_in), dtype=np.float32)
    weight = stored(rng.standard_normal((dim_out, dim_in), dtype=np.float32), storage)
    np.testing.assert_allclose(_run(x, weight), linear_ref(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", STORAGES)
def test_linear_narrow_reads_when_rows_are_not_whole_words(rng, storage):
    x = rng.standard_normal((2, 13), dtype=np.float32)
    weight = stored(rng.standard_normal((5, 13), dtype=np.float32), storage)
    assert nmse(_run(x, weight), linear_ref(x, weight)) < 1e-12


def test_linear_row_does_not_depend_on_the_rest_of_the_batch(rng):
    x = rng.standard_normal((MAX_TOKENS + 2, 16), dtype=np.float32)
    weight = stored(rng.standard_normal((6, 16), dtype=np.float32), "bf16")
    alone = _run(x[-1:], weight)
    together = _run(x, weight)
    np.testing.assert_array_equal(alone[0], together[-1])  # bit for bit


def test_linear_rejects_mismatched_inner_dim():
    with pytest.raises(ValueError, match="weight"):
        linear_cuda(device(np.zeros((1, 8), np.float32)), device(np.zeros((4, 6), np.float32)), poisoned((1, 4)))


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("num_tokens, dim_in, dim_out", [(1, 40, 3), (MAX_TOKENS + 1, 36, 2), (2, 13, 3)])
def test_linear_split_rows_match_ref(rng, monkeypatch, storage, num_tokens, dim_in, dim_out):
    # rows cut among the warps of a block (split-K), spans of unequal length and idle lanes included
    from moebus.cuda.kernels import linear

    monkeypatch.setattr(linear, "MIN_SPAN_WORDS", 1)
    monkeypatch.setattr(linear, "SPLIT_TARGET_WARPS", 1 << 30)
    assert linear.row_split(dim_out, dim_in, 2) == 2
    x = rng.standard_normal((num_tokens, dim_in), dtype=np.float32)
    weight = stored(rng.standard_normal((dim_out, dim_in), dtype=np.float32), storage)
    np.testing.assert_allclose(_run(x, weight), linear_ref(x, weight), rtol=1e-5, atol=1e-5)


def test_linear_splits_few_long_rows_only():
    from moebus.cuda.kernels.linear import row_split

    assert row_split(2048, 1024, 4) == 4  # the o projection of an A3B layer: 2048 rows of 4096
    assert row_split(5120, 512, 4) == 2  # its fused qkv
    assert row_split(32, 512, 4) == 4  # a router
    assert row_split(151936, 512, 4) == 1  # lm_head
    assert row_split(32, 512, 2) == 2  # never more warps than a block has


@pytest.mark.parametrize("short_rows", [1, 2, 3, 4])
def test_linear_row_is_the_same_whatever_the_rows_per_warp(rng, monkeypatch, short_rows):
    # a pass of 1 token (ROWS_PER_WARP_SHORT rows a warp) and of MAX_TOKENS (ROWS_PER_WARP rows a
    # warp) sum a row the same way, split or not: bit for bit
    from moebus.cuda.kernels import linear

    monkeypatch.setattr(linear, "MIN_SPAN_WORDS", 1)
    monkeypatch.setattr(linear, "SPLIT_TARGET_WARPS", 1 << 30)
    monkeypatch.setattr(linear, "ROWS_PER_WARP", 4)
    monkeypatch.setattr(linear, "ROWS_PER_WARP_SHORT", short_rows)
    monkeypatch.setattr(linear, "MAX_UNROLL", 8)
    assert linear.shape_for(MAX_TOKENS, 512) == (2, 4) and linear.shape_for(1, 512) == (8, short_rows)
    assert linear.shape_for(1, 40) == (2, short_rows)  # never more words a round than the span gives a lane
    x = rng.standard_normal((MAX_TOKENS, 40), dtype=np.float32)
    weight = stored(rng.standard_normal((7, 40), dtype=np.float32), "bf16")
    together = _run(x, weight)
    np.testing.assert_allclose(together, linear_ref(x, weight), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(_run(x[3:4], weight)[0], together[3])
