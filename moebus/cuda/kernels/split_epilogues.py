"""Ops that hand a tensor-core product its input already split (gemm.py: x = hi + lo, bf16 parts):
LayerNorm and bias + activation write the parts, (parts, R, D) bf16 bits, instead of a float32
result that gemm.split_rows would read back and split (once per product: three times for a tower's
q, k and v). The parts hold the same float32 values (layernorm_ref, bias_activation_ref) split as
split_rows splits them, so the products over them equal the unfused ones bit for bit.

``SplitRows`` carries the parts to CudaBackend.tiled_linear (``linear_of_parts``) and to
``tiled_linears`` (``linears_of_parts``: q, k and v of one fused weight in one strided-batched
product per part, each result contiguous); ``shape`` is x's (R, D). ``SplitInputOps`` (CudaBackend's
base) holds the backend's ops; the ``*_into_ref`` and ``tiled_linears_ref`` functions are the cpu
backend's: there every product reads float32, so they return the float32 results."""
from __future__ import annotations

import functools
import os

import numpy as np

from moebus.cuda.kernels import layernorm, split_two_parts, vision_attention
from moebus.cuda.kernels.activations import DEVICE_FNS, add_bias_cuda
from moebus.cuda.kernels.compat import (bits_as_f32, blocks, cuda, device, f32_bits, float32, kernel, threads, uint16,
                                        uint32)
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.gemm import COMPUTE_32F, OP_N, OP_T, R_16BF, add_bias_rows_cuda, address, split_bf16_ref
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, require, warp_per_row
from moebus.cuda.kernels.layernorm import block_warps, layernorm_ref, rows_kernel
from moebus.cuda.kernels.loads import SCALAR, reader_view, storage_of
from moebus.cuda.kernels.tiled_linear import ROW_THREADS, bias_activation_ref, tiled_linear_ref


# bias + activation (split) over rows of an even width: each thread stores two elements' parts as one
# 32-bit word (bias_activation_split_pairs; 0: one 16-bit store per element and part, the ninth session's)
PAIRED_STORES = os.environ.get("MOEBUS_SPLIT_PAIRED_STORES", "1") != "0"


class SplitRows:
    """x (R, D) float32 as its bf16 parts (parts, R, D) uint16 on the device."""

    def __init__(self, parts):
        self.parts = parts
        self.shape = (parts.shape[1], parts.shape[2])


def layernorm_into_ref(x, weight, bias, eps: float, next_weight) -> np.ndarray:
    """LayerNorm of x as the input of products by ``next_weight``: float32 (the cpu backend's)."""
    return layernorm_ref(x, weight, bias, eps)


def residual_layernorm_into_ref(x, y, residual_bias, weight, bias, eps: float, next_weight) -> tuple:
    """(x + (y + residual_bias), its LayerNorm) as the input of products by ``next_weight``: float32."""
    return layernorm.residual_layernorm_ref(x, y, residual_bias, weight, bias, eps)


def bias_activation_into_ref(y, bias, name: str, next_weight) -> np.ndarray:
    """activation(y + bias) as the input of products by ``next_weight``: float32 (the cpu backend's)."""
    return bias_activation_ref(y, bias, name)


def tiled_linears_ref(x, weight, biases) -> tuple:
    """x @ W_i^T (+ b_i) for the ``len(biases)`` equal row blocks W_i of ``weight`` (q, k, v of a
    fused qkv), each bias None or (N / count,) stored."""
    size = weight.shape[0] // len(biases)
    return tuple(tiled_linear_ref(x, weight[i * size:(i + 1) * size], bias) for i, bias in enumerate(biases))


def layernorm_split_ref(x, weight, bias, eps: float, parts: int = 2) -> np.ndarray:
    return split_bf16_ref(layernorm_ref(x, weight, bias, eps), parts)


def bias_activation_split_ref(y, bias, name: str, parts: int = 2) -> np.ndarray:
    return split_bf16_ref(bias_activation_ref(y, bias, name), parts)


# -- cuda -----------------------------------------------------------------------------------------

@device
def _store_split(out, r, d, value):
    # out[:, r, d] = the parts of value, as gemm.split_rows computes them
    rest = value
    for i in range(out.shape[0]):
        bits = f32_bits(rest)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest even (f32_to_bf16)
        out[i, r, d] = uint16(rounded)
        rest = float32(rest - bits_as_f32(rounded << 16))


@functools.cache
def _bias_activation_split_kernel(storage: str, name: str):
    load, fn = SCALAR[storage], DEVICE_FNS[name]

    @kernel
    def bias_activation_split(y, bias, out):
        # out[:, r, d] = the parts of fn(y[r, d] + bias[d]); a block per row, threads along it, each
        # thread's four elements (a block's width apart) loaded before any is computed (layernorm.py:
        # one load at a time waits out each load's latency); indices past the row clamped, unused
        grid_dependency_wait()  # pdl.py: before any global read or write
        dim, step = y.shape[1], cuda.blockDim.x
        for r in range(cuda.blockIdx.x, y.shape[0], cuda.gridDim.x):
            for d in range(cuda.threadIdx.x, dim, 4 * step):
                d1, d2, d3 = min(d + step, dim - 1), min(d + 2 * step, dim - 1), min(d + 3 * step, dim - 1)
                y0, y1, y2, y3 = y[r, d], y[r, d1], y[r, d2], y[r, d3]
                b0, b1, b2, b3 = load(bias, 0, d), load(bias, 0, d1), load(bias, 0, d2), load(bias, 0, d3)
                _store_split(out, r, d, fn(y0 + b0))
                if d + step < dim:
                    _store_split(out, r, d1, fn(y1 + b1))
                if d + 2 * step < dim:
                    _store_split(out, r, d2, fn(y2 + b2))
                if d + 3 * step < dim:
                    _store_split(out, r, d3, fn(y3 + b3))

    return bias_activation_split


@device
def _bf16_rounded(value):
    # bf16 bits of value, rounded to nearest even, as _store_split (f32_to_bf16)
    bits = f32_bits(value)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@device
def _store_split_pair(out, r, j, value0, value1):
    # out[:, r, j] = the parts of value0 (low half) and value1 (high half), each as _store_split computes them
    rest0, rest1 = value0, value1
    for i in range(out.shape[0]):
        hi0, hi1 = _bf16_rounded(rest0), _bf16_rounded(rest1)
        out[i, r, j] = uint32(hi0 | (hi1 << 16))
        rest0 = float32(rest0 - bits_as_f32(hi0 << 16))
        rest1 = float32(rest1 - bits_as_f32(hi1 << 16))


@functools.cache
def _bias_activation_split_pairs_kernel(storage: str, name: str):
    load, fn = SCALAR[storage], DEVICE_FNS[name]

    @kernel
    def bias_activation_split_pairs(y, bias, out):
        # out (parts, R, D / 2) uint32 = the parts of fn(y[r, d] + bias[d]) for d = 2j (low half), 2j + 1
        # (high half): the values and roundings of bias_activation_split, each thread's two pairs (a
        # block's width apart) loaded before any is computed, one 32-bit store per pair and part
        grid_dependency_wait()  # pdl.py: before any global read or write
        pairs, step = out.shape[2], cuda.blockDim.x
        for r in range(cuda.blockIdx.x, y.shape[0], cuda.gridDim.x):
            for j in range(cuda.threadIdx.x, pairs, 2 * step):
                j1 = min(j + step, pairs - 1)
                d0, d1 = 2 * j, 2 * j1
                y0, y1, y2, y3 = y[r, d0], y[r, d0 + 1], y[r, d1], y[r, d1 + 1]
                b0, b1 = load(bias, 0, d0), load(bias, 0, d0 + 1)
                b2, b3 = load(bias, 0, d1), load(bias, 0, d1 + 1)
                _store_split_pair(out, r, j, fn(y0 + b0), fn(y1 + b1))
                if j + step < pairs:
                    _store_split_pair(out, r, j1, fn(y2 + b2), fn(y3 + b3))

    return bias_activation_split_pairs


def _check_out(out, rows: int, dim: int) -> None:
    require("out", out, np.uint16, ndim=3)
    if tuple(out.shape[1:]) != (rows, dim):
        raise ValueError(f"out: shape {tuple(out.shape)} for rows of ({rows}, {dim})")


def layernorm_split_cuda(x, weight, bias, eps: float, out, stream=0):
    """out (parts, R, D) bf16 bits = layernorm_split_ref(x, weight, bias, eps, parts)."""
    require("x", x, np.float32, ndim=2)
    num_rows, dim = x.shape
    require("weight", weight, WEIGHT_DTYPES, shape=(dim,))
    require("bias", bias, (weight.dtype,), shape=(dim,))
    _check_out(out, num_rows, dim)
    if num_rows:
        grid, block = warp_per_row(num_rows, min(block_warps(dim), num_rows))
        kernel = rows_kernel(storage_of(weight), dim, _store_split, out)  # layernorm.py's, its result stored as parts
        kernel[grid, block, stream](x, reader_view(weight, wide=False), reader_view(bias, wide=False), np.float32(eps),
                                    out)
    return out


def bias_activation_split_cuda(y, bias, name: str, out, stream=0):
    """out (parts, R, D) bf16 bits = bias_activation_split_ref(y, bias, name, parts)."""
    if name not in DEVICE_FNS:
        raise ValueError(f"unknown activation {name!r} (known: {sorted(DEVICE_FNS)})")
    require("y", y, np.float32, ndim=2)
    require("bias", bias, WEIGHT_DTYPES, shape=(y.shape[1],))
    _check_out(out, *y.shape)
    if y.size and PAIRED_STORES and y.shape[1] % 2 == 0:
        kernel = split_two_parts.bias_activation_pairs_kernel(storage_of(bias), name) \
            if split_two_parts.TWO_PARTS and out.shape[0] == 2 else _bias_activation_split_pairs_kernel(storage_of(bias), name)
        kernel[blocks(y.shape[0]), threads(ROW_THREADS), stream](y, reader_view(bias, wide=False), out.view(np.uint32))
    elif y.size:
        kernel = _bias_activation_split_kernel(storage_of(bias), name)
        kernel[blocks(y.shape[0]), threads(ROW_THREADS), stream](y, reader_view(bias, wide=False), out)
    return out


def linear_of_parts(ops, x: SplitRows, weight, bias, out):
    """out (R, N) float32 = x @ weight^T (+ bias) on ``ops``' tensor cores, x already split."""
    tc = ops.tensor_cores
    require("weight", weight, np.uint16, shape=(None, x.shape[1]))
    require("out", out, np.float32, shape=(x.shape[0], weight.shape[0]))
    if x.parts.shape[0] != tc.parts:
        raise ValueError(f"{x.parts.shape[0]} parts for tensor cores of precision {tc.precision!r}")
    tc.matmul_nt(ops, x.parts, 0, x.shape[0], address(weight), weight.shape[0], out)
    return _with_bias(ops, out, bias)


def linears_of_parts(ops, x: SplitRows, weight, biases, out) -> tuple:
    """tiled_linears_ref(x, weight, biases) on ``ops``' tensor cores into out (count, R, N / count)
    float32: per part one strided-batched product over the count row blocks of weight (bf16), the
    second part accumulating into the first; then each bias that is not None."""
    tc, count = ops.tensor_cores, len(biases)
    rows, dim_in = x.shape
    size = weight.shape[0] // count
    require("weight", weight, np.uint16, shape=(count * size, dim_in))
    require("out", out, np.float32, shape=(count, rows, size))
    if x.parts.shape[0] != tc.parts:
        raise ValueError(f"{x.parts.shape[0]} parts for tensor cores of precision {tc.precision!r}")
    for i in range(tc.parts):
        tc.blas.gemm(ops.stream, OP_T, OP_N, size, rows, dim_in, address(weight), R_16BF, dim_in,
                     address(x.parts) + i * rows * dim_in * 2, R_16BF, dim_in, address(out), size,
                     beta=1.0 if i else 0.0, compute=COMPUTE_32F, batch=count, stride_a=size * dim_in, stride_b=0,
                     stride_c=rows * size)
    return tuple(_with_bias(ops, out[i], bias) for i, bias in enumerate(biases))


def _with_bias(ops, out, bias):
    if bias is None:
        return out
    if bias.dtype == np.uint16:
        return add_bias_rows_cuda(out, bias, stream=ops.stream)
    return add_bias_cuda(out, bias, out, stream=ops.stream)


class SplitInputOps:
    """CudaBackend's ops that hand products split inputs (``self``: the backend: ``tensor_cores``,
    ``empty``, ``stream``, ``layernorm``, ``bias_activation``, ``tiled_linear``)."""

    def _splits_for(self, x, next_weight) -> bool:
        return self.tensor_cores is not None and self.tensor_cores.wants(x.shape[0], next_weight)

    def layernorm_into(self, x, weight, bias, eps: float, next_weight):
        """layernorm(x) as the input of products by ``next_weight``: split for the tensor cores
        (SplitRows) where they will take them, else float32."""
        if not self._splits_for(x, next_weight):
            return self.layernorm(x, weight, bias, eps)
        parts = self.empty((self.tensor_cores.parts, *x.shape), np.uint16)
        return SplitRows(layernorm_split_cuda(x, weight, bias, eps, parts, stream=self.stream))

    def residual_layernorm_into(self, x, y, residual_bias, weight, bias, eps: float, next_weight):
        """(x + (y + residual_bias), the layernorm_into of that) in one pass (layernorm.py's
        residual_layernorm_cuda): the residual add of a product before the next block's norm."""
        x_out = self.empty(x.shape)
        if not self._splits_for(x, next_weight):
            return layernorm.residual_layernorm_cuda(x, y, residual_bias, weight, bias, eps, x_out, self.empty(x.shape),
                                                     stream=self.stream)
        parts = self.empty((self.tensor_cores.parts, *x.shape), np.uint16)
        layernorm.residual_layernorm_cuda(x, y, residual_bias, weight, bias, eps, x_out, parts, stream=self.stream)
        return x_out, SplitRows(parts)

    def bias_activation_into(self, y, bias, name: str, next_weight):
        """bias_activation(y, bias, name) as the input of products by ``next_weight`` (layernorm_into)."""
        if not self._splits_for(y, next_weight):
            return self.bias_activation(y, bias, name)
        parts = self.empty((self.tensor_cores.parts, *y.shape), np.uint16)
        return SplitRows(bias_activation_split_cuda(y, bias, name, parts, stream=self.stream))

    def tiled_linears(self, x, weight, biases):
        """tiled_linear by each of the len(biases) equal row blocks of ``weight`` (q, k and v of a fused
        qkv), each with its bias or None: one strided-batched product per part where x is split."""
        count, rows = len(biases), x.shape[0]
        size = weight.shape[0] // count
        if isinstance(x, SplitRows):
            return linears_of_parts(self, x, weight, biases, self.empty((count, rows, size)))
        return tuple(self.tiled_linear(x, weight[i * size:(i + 1) * size], bias) for i, bias in enumerate(biases))

    def rope_attention_ready(self, rows: int, head_dim: int, bias) -> bool:
        """Whether ``rope_image_attention`` takes a tower's attention of ``rows`` patches (one image)."""
        return vision_attention.rope_attention_ready(self.tensor_cores, rows, head_dim, bias)

    def rope_image_attention(self, q, k, v, bias, rope_pos, axes, cos, sin, scale: float, next_weight=None):
        """One image's attention after the tower's rotary, from the qkv product's results without
        their biases (q, k, v (P, H, hd) float32, bias (3 H hd,) bf16): rotary, biases and the keys'
        and values' split in one pass, then the fused kernel (vision_attention.rope_image_attention_cuda).
        (P, H, hd) float32, or, where products by ``next_weight`` take split inputs (layernorm_into),
        its (P, H hd) rows split by the kernel as it stores them (SplitRows)."""
        rows, heads, head_dim = q.shape
        if next_weight is None or not self._splits_for(q, next_weight):
            return vision_attention.rope_image_attention_cuda(self, q, k, v, bias, rope_pos, axes, cos, sin, 1, scale,
                                                              self.empty(q.shape))
        parts = self.empty((self.tensor_cores.parts, rows, heads * head_dim), np.uint16)
        vision_attention.rope_image_attention_cuda(self, q, k, v, bias, rope_pos, axes, cos, sin, 1, scale, parts)
        return SplitRows(parts)
