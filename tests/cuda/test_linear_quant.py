"""The FP8 dense GEMV (attention projections with attention.dtype fp8) and its bf16 conversion
against their numpy references."""
import numpy as np
import pytest

from moebus.common.fp8_dense import fp8_rows
from moebus.common.quant import fp8_quantize, fp8_dequantize
from moebus.cuda.kernels.linear_quant import (fp8_rows_dequantize, fp8_to_bf16_cuda, fp8_to_bf16_ref,
                                              linear_fp8_cuda, linear_fp8_ref)
from tests.cuda.conftest import device, poisoned


@pytest.fixture(autouse=True)
def _eight_byte_kernel(monkeypatch):
    """This file's GEMV tests are linear_quant.py's own kernel's (test_linear_quant_fp8.py: the one-round one)."""
    from moebus.cuda.kernels import linear_quant

    monkeypatch.setattr(linear_quant, "ONE_ROUND", False)


def _weight(rng, rows, cols):
    # unequal scales along rows and columns: a wrong scale index shows
    ramp = np.linspace(0.2, 1.5, cols, dtype=np.float32)
    return rng.standard_normal((rows, cols), dtype=np.float32) * ramp * np.linspace(2.0, 0.5, rows)[:, None]


def _close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("tokens,rows,cols", [(1, 5, 256), (3, 7, 136), (11, 4, 512), (2, 6, 2048), (5, 3, 4096)])
def test_linear_fp8_matches_ref(rng, tokens, rows, cols):
    # 136 columns: a partial edge block and rows that are not whole rounds; 11 tokens: two passes;
    # 2048 and 4096: q/k/v's and o's rows (whole rounds of 8 words a lane at 1-2 tokens, 2 at more)
    codes, scales = fp8_rows(_weight(rng, rows, cols))
    x = rng.standard_normal((tokens, cols), dtype=np.float32)
    out = poisoned((tokens, rows))
    linear_fp8_cuda(device(x), device(codes), device(scales), out)
    _close(out.copy_to_host(), linear_fp8_ref(x, codes, scales))


def test_row_scales_are_the_block_grids_for_every_row(rng):
    w = _weight(rng, 130, 136)  # partial blocks in both directions
    codes, block_scales = fp8_quantize(w)
    row_codes, row_scales = fp8_rows(w)
    np.testing.assert_array_equal(row_codes, codes)
    assert row_scales.shape == (130, 2)
    np.testing.assert_array_equal(fp8_rows_dequantize(row_codes, row_scales), fp8_dequantize(codes, block_scales))


def test_fp8_to_bf16_matches_ref(rng):
    codes, scales = fp8_rows(_weight(rng, 9, 200))
    out = device(np.full((9, 200), 0x7FC1, np.uint16))  # bf16 NaN bits: unwritten elements show
    fp8_to_bf16_cuda(device(codes), device(scales), out)
    np.testing.assert_array_equal(out.copy_to_host(), fp8_to_bf16_ref(codes, scales))


def test_linear_fp8_refuses_bad_shapes(rng):
    codes, scales = fp8_rows(_weight(rng, 4, 64))
    x = device(np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="columns"):
        linear_fp8_cuda(device(np.zeros((1, 72), np.float32)), device(codes), device(scales), poisoned((1, 4)))
    with pytest.raises(ValueError, match="scales"):
        linear_fp8_cuda(x, device(codes), device(scales[:, :0]), poisoned((1, 4)))
    with pytest.raises(TypeError, match="codes"):
        linear_fp8_cuda(x, device(codes.astype(np.float32)), device(scales), poisoned((1, 4)))


def test_fp8_rows_in_parallel_pieces_equal_the_whole(rng):
    from concurrent.futures import ThreadPoolExecutor

    w = _weight(rng, 1100, 136)  # 3 pieces of 512 rows, the last partial
    with ThreadPoolExecutor(2) as pool:
        parts = fp8_rows(w, pool)
    whole = fp8_rows(w)
    for a, b in zip(parts, whole):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tokens", [2, 40])
def test_backend_linear_takes_fp8_weights(rng, tokens):
    """ops.linear on an Fp8Weight: the FP8 GEMV, or with 40 tokens on a GPU the weight as bf16 scratch
    for the tensor cores (bf16 holds every e4m3 value times a scale to 8 bits: within 2^-8)."""
    from moebus.cuda.backends.cuda import CudaBackend

    ops = CudaBackend()
    codes, scales = fp8_rows(_weight(rng, 64, 256))
    x = rng.standard_normal((tokens, 256), dtype=np.float32)
    out = ops.to_host(ops.linear(ops.upload(x), ops.fp8_weight(codes, scales)))
    expected = linear_fp8_ref(x, codes, scales)
    np.testing.assert_allclose(out, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


@pytest.mark.parametrize("tokens", [1, 5])
def test_linear_fp8_gives_the_same_bits_whatever_the_rows_a_warp(rng, tokens, monkeypatch):
    # lane l sums words l, l + 32, ... of a row in that order whatever rows its warp takes: the work
    # shapes (linear_quant.ROWS_PER_WARP*, MIN_WARPS) change no result; 7 rows: partial last groups
    from moebus.cuda.kernels import linear_quant

    codes, scales = fp8_rows(_weight(rng, 7, 520))  # 65 words a row: lanes loop, rounds are not whole
    x = rng.standard_normal((tokens, 520), dtype=np.float32)
    monkeypatch.setattr(linear_quant, "MIN_WARPS", 1)
    results = _equal_bits_over(monkeypatch, x, codes, scales,
                               [{"ROWS_PER_WARP_SHORT": rows, "ROWS_PER_WARP": rows} for rows in (1, 2, 3, 4)])
    _close(results[0], linear_fp8_ref(x, codes, scales))


def _equal_bits_over(monkeypatch, x, codes, scales, settings: list[dict]) -> list:
    """The FP8 GEMV's outputs with each setting of linear_quant's constants, asserted equal bit for bit."""
    from moebus.cuda.kernels import linear_quant

    results = []
    for setting in settings:
        for name, value in setting.items():
            monkeypatch.setattr(linear_quant, name, value)
        out = poisoned((x.shape[0], codes.shape[0]))
        linear_fp8_cuda(device(x), device(codes), device(scales), out)
        results.append(out.copy_to_host())
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    return results


def test_projection_rows_a_warp_keep_enough_warps(monkeypatch):
    from moebus.cuda.kernels import linear_quant

    monkeypatch.setattr(linear_quant, "ROWS_PER_WARP_SHORT", 4)
    monkeypatch.setattr(linear_quant, "MIN_WARPS", 1024)
    assert linear_quant.rows_for(5120, 1) == 4  # A3B's qkv: 1280 warps
    assert linear_quant.rows_for(2048, 1) == 2  # its o: 1024 warps, not 512
    assert linear_quant.rows_for(100, 1) == 1


@pytest.mark.parametrize("tokens", [1, 2])
def test_linear_fp8_round_gate_gives_the_same_bits(rng, tokens, monkeypatch):
    # ROUND_GATE starts each word's sum from a +0.0 made of the round's words' and scales' bits (so ptxas
    # issues the round's loads before its first FFMA): the same sums, the same bits; 16 words a lane a
    # round as well (MAX_UNROLL 16 at one row a warp)
    from moebus.cuda.kernels import linear_quant

    codes, scales = fp8_rows(_weight(rng, 7, 520))  # 65 words a row: rounds are not whole
    x = rng.standard_normal((tokens, 520), dtype=np.float32)
    monkeypatch.setattr(linear_quant, "MIN_WARPS", 1)
    results = _equal_bits_over(monkeypatch, x, codes, scales,
                               [{"ROUND_GATE": gate, "MAX_UNROLL": unroll, "ROWS_PER_WARP_SHORT": 1}
                                for gate, unroll in ((False, 8), (True, 8), (True, 16))])
    _close(results[1], linear_fp8_ref(x, codes, scales))
