"""LayerNorm and bias + activation that write a tensor-core product's split input (split_epilogues.py):
bit for bit the unfused pair (the op, then gemm.split_rows), near their numpy references, the product
over the parts equal to the product over the float32 input, and the cpu backend's ``*_into`` ops."""
import inspect

import numpy as np
import pytest

from moebus.cuda.backends.cpu import CpuBackend
from moebus.cuda.backends.cuda import CudaBackend
from moebus.cuda.dtypes import bf16_to_f32, f32_to_bf16
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import TensorCores, split_rows_cuda
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.cuda.kernels.layernorm import layernorm_cuda, layernorm_ref
from moebus.cuda.kernels.split_epilogues import (SplitRows, bias_activation_split_cuda, bias_activation_split_ref,
                                                 layernorm_split_cuda, layernorm_split_ref)
from moebus.cuda.kernels.tiled_linear import bias_activation_cuda
from tests.cuda.conftest import STORAGES, device, stored


def _split_of(ops_result, parts: int) -> np.ndarray:
    out = device(np.zeros((parts,) + tuple(ops_result.shape), np.uint16))
    return split_rows_cuda(ops_result, out).copy_to_host()


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("parts", [2, 1])
def test_layernorm_split_is_layernorm_then_split(rng, storage, parts):
    x = rng.standard_normal((6, 45), dtype=np.float32) * 3 + 1
    weight, bias = (stored(rng.standard_normal(45, dtype=np.float32), storage) for _ in range(2))
    got = layernorm_split_cuda(device(x), device(weight), device(bias), 1e-6,
                               device(np.zeros((parts, 6, 45), np.uint16))).copy_to_host()
    unfused = layernorm_cuda(device(x), device(weight), device(bias), 1e-6, device(np.zeros((6, 45), np.float32)))
    np.testing.assert_array_equal(got, _split_of(unfused, parts))
    want = layernorm_split_ref(x, weight, bias, 1e-6, parts)
    np.testing.assert_allclose(bf16_to_f32(got).sum(0), bf16_to_f32(want).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("dim,parts,paired", [(37, 2, True), (150, 2, True), (150, 1, True), (150, 2, False)])
def test_bias_activation_split_is_bias_activation_then_split(rng, monkeypatch, name, dim, parts, paired):
    """Odd widths store element by element; even ones two elements' parts a 32-bit word (PAIRED_STORES),
    150 = a pair past the simulator's 32 threads x 2 pairs: the clamped second pair and the loop's tail."""
    from moebus.cuda.kernels import split_epilogues

    monkeypatch.setattr(split_epilogues, "PAIRED_STORES", paired)
    y = rng.standard_normal((5, dim), dtype=np.float32)
    bias = device(f32_to_bf16(rng.standard_normal(dim, dtype=np.float32)))
    got = bias_activation_split_cuda(device(y), bias, name, device(np.full((parts, 5, dim), 0xFFFF, np.uint16)))
    got = got.copy_to_host()
    unfused = bias_activation_cuda(device(y), bias, name, device(np.zeros((5, dim), np.float32)))
    np.testing.assert_array_equal(got, _split_of(unfused, parts))
    want = bias_activation_split_ref(y, bias.copy_to_host(), name, parts)
    np.testing.assert_allclose(bf16_to_f32(got).sum(0), bf16_to_f32(want).sum(0), rtol=1e-5, atol=1e-6)


def test_bad_parts_are_refused(rng):
    x = device(rng.standard_normal((4, 8), dtype=np.float32))
    w = device(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="out: shape"):
        layernorm_split_cuda(x, w, w, 1e-6, device(np.zeros((2, 4, 9), np.uint16)))
    with pytest.raises(ValueError, match="unknown activation"):
        bias_activation_split_cuda(x, w, "swish?", device(np.zeros((2, 4, 8), np.uint16)))


def test_the_backends_products_over_split_inputs_equal_the_unfused_ones(rng):
    """cuda with cuBLAS (on numpy in the simulator) from 4 rows: layernorm_into gives parts, and tiled_linear over them (with
    a bf16 bias) equals tiled_linear over the float32 layernorm; fewer rows keep float32. On cpu the
    same calls give the float32 results."""
    ops = CudaBackend()
    ops.tensor_cores = TensorCores(HostBlas() if SIMULATOR else cublas_blas(), min_rows=4)
    ops.begin_step()
    x = rng.standard_normal((6, 16), dtype=np.float32)
    norm_w, norm_b = (rng.standard_normal(16, dtype=np.float32) for _ in range(2))
    weight = f32_to_bf16(rng.standard_normal((8, 16), dtype=np.float32))
    bias = f32_to_bf16(rng.standard_normal(8, dtype=np.float32))
    dx, dw, dnw, dnb, db = (ops.weight(a) for a in (x, weight, norm_w, norm_b, bias))
    h = ops.layernorm_into(dx, dnw, dnb, 1e-6, dw)
    assert isinstance(h, SplitRows) and h.shape == (6, 16)
    got = ops.to_host(ops.tiled_linear(h, dw, db))
    want = ops.to_host(ops.tiled_linear(ops.layernorm(dx, dnw, dnb, 1e-6), dw, db))
    np.testing.assert_array_equal(got, want)
    a = ops.bias_activation_into(ops.tiled_linear(h, dw), db, "gelu_pytorch_tanh", dw[:, :8])
    assert isinstance(a, SplitRows)
    few = ops.layernorm_into(dx[:3], dnw, dnb, 1e-6, dw)
    assert not isinstance(few, SplitRows) and few.shape == (3, 16)
    cpu = CpuBackend()
    np.testing.assert_array_equal(cpu.layernorm_into(x, norm_w, norm_b, 1e-6, weight),
                                  layernorm_ref(x, norm_w, norm_b, 1e-6))
    for name in ("layernorm_into", "bias_activation_into"):
        assert list(inspect.signature(getattr(CudaBackend, name)).parameters)[1:] == \
            list(inspect.signature(getattr(CpuBackend, name)).parameters)


def test_q_k_v_of_one_fused_weight_in_one_product_per_part(rng):
    """tiled_linears over split rows: a strided-batched product per part (2 calls, not 6), each
    result contiguous, equal to three products by the weight's row blocks; on cpu the same values."""
    from tests.cuda.test_prefill_tensor_cores import CountingBlas
    from moebus.cuda.kernels.split_epilogues import tiled_linears_ref

    ops = CudaBackend()
    blas = CountingBlas(HostBlas() if SIMULATOR else cublas_blas())
    ops.tensor_cores = TensorCores(blas, min_rows=4)
    ops.begin_step()
    x = rng.standard_normal((6, 16), dtype=np.float32)
    weight = f32_to_bf16(rng.standard_normal((3 * 8, 16), dtype=np.float32))
    v_bias = f32_to_bf16(rng.standard_normal(8, dtype=np.float32))
    norm = np.ones(16, np.float32)
    h = ops.layernorm_into(ops.weight(x), ops.weight(norm), ops.weight(0 * norm), 1e-6, ops.weight(weight))
    got = ops.tiled_linears(h, ops.weight(weight), (None, None, ops.weight(v_bias)))
    assert blas.calls == 2 and all(y.shape == (6, 8) and y.is_c_contiguous() for y in got)
    separate = [ops.tiled_linear(h, ops.weight(weight[i * 8:(i + 1) * 8]), b) for i, b in
                enumerate((None, None, ops.weight(v_bias)))]
    for a, b in zip(got, separate):
        np.testing.assert_allclose(ops.to_host(a), ops.to_host(b), rtol=1e-6, atol=1e-6)
    want = tiled_linears_ref(layernorm_ref(x, norm, 0 * norm, 1e-6), weight, (None, None, v_bias))
    for a, b in zip(got, want):
        np.testing.assert_allclose(ops.to_host(a), b, rtol=1e-4, atol=1e-4)
    cpu = CpuBackend().tiled_linears(x, weight, (None, None, v_bias))
    assert [y.shape for y in cpu] == [(6, 8)] * 3
