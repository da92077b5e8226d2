"""The vision towers' element-wise ops: the activations named in configs (exact and tanh GELU,
quick_gelu, silu, relu) and the row-broadcast add that applies a bias (B = 1) or a table of
position embeddings (B = positions per image) to rows of a (R, D) activation."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import blocks, cuda, device, float32, threads, kernel
from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, ceil_div, require
from moebus.cuda.kernels.loads import SCALAR, reader_view, storage_of

THREADS = 256
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_ref(x: np.ndarray) -> np.ndarray:
    # torch's exact GELU: x * Phi(x); erf in float64 then rounded (numpy has no float32 erf)
    x = np.asarray(x, dtype=np.float32)
    return (np.float32(0.5) * x * (np.float32(1.0) + _erf(x / np.float32(math.sqrt(2.0))).astype(np.float32)))


def gelu_tanh_ref(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    inner = np.float32(SQRT_2_OVER_PI) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


def quick_gelu_ref(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / (np.float32(1.0) + np.exp(np.float32(-1.702) * x))


def silu_ref(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / (np.float32(1.0) + np.exp(-x))


def relu_ref(x: np.ndarray) -> np.ndarray:
    return np.maximum(np.asarray(x, dtype=np.float32), np.float32(0.0))


REFS = {"gelu": gelu_ref, "gelu_pytorch_tanh": gelu_tanh_ref, "gelu_new": gelu_tanh_ref,
        "quick_gelu": quick_gelu_ref, "silu": silu_ref, "relu": relu_ref}


def activation_ref(x: np.ndarray, name: str) -> np.ndarray:
    # x (...) float32 -> same shape float32
    return REFS[name](x)


def add_bias_ref(x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    # x (R, D) float32, bias (B, D) or (D,) stored with R % B == 0 -> out[r] = x[r] + bias[r % B]
    table = to_f32(bias).reshape(-1, x.shape[1])
    return (np.asarray(x, np.float32).reshape(-1, table.shape[0], x.shape[1]) + table).reshape(x.shape)


# -- cuda -----------------------------------------------------------------------------------------

@device
def _gelu(v):
    return float32(0.5) * v * (float32(1.0) + math.erf(v * float32(0.7071067811865476)))


@device
def _gelu_tanh(v):
    inner = float32(SQRT_2_OVER_PI) * (v + float32(0.044715) * v * v * v)
    return float32(0.5) * v * (float32(1.0) + math.tanh(inner))


@device
def _quick_gelu(v):
    return v / (float32(1.0) + math.exp(float32(-1.702) * v))


@device
def _silu(v):
    return v / (float32(1.0) + math.exp(-v))


@device
def _relu(v):
    return max(v, float32(0.0))


DEVICE_FNS = {"gelu": _gelu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_tanh,
              "quick_gelu": _quick_gelu, "silu": _silu, "relu": _relu}


@functools.cache
def _activation_kernel(name: str):
    fn = DEVICE_FNS[name]

    @kernel
    def activation_flat(x, out):
        for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
            out[i] = fn(x[i])

    return activation_flat


def activation_cuda(x, name: str, out, stream=0):
    """out = activation_ref(x, name) (float32, same shape, C order)."""
    if name not in DEVICE_FNS:
        raise ValueError(f"unknown activation {name!r} (known: {sorted(DEVICE_FNS)})")
    require("x", x, np.float32)
    require("out", out, np.float32, shape=tuple(x.shape))
    if x.size:
        kernel = _activation_kernel(name)
        kernel[blocks(ceil_div(x.size, THREADS)), threads(THREADS), stream](x.reshape(x.size), out.reshape(out.size))
    return out


@functools.cache
def _add_bias_kernel(storage: str):
    load = SCALAR[storage]

    @kernel
    def add_bias_flat(x, bias, out):
        num_rows, dim = x.shape
        table_rows = bias.shape[0]
        for i in range(cuda.grid(1), num_rows * dim, cuda.gridsize(1)):
            r, d = i // dim, i % dim
            out[r, d] = x[r, d] + load(bias, r % table_rows, d)

    return add_bias_flat


def add_bias_cuda(x, bias, out, stream=0):
    """out = add_bias_ref(x, bias); x, out (R, D) float32, bias (B, D) or (D,) stored, R % B == 0."""
    require("x", x, np.float32, ndim=2)
    require("bias", bias, WEIGHT_DTYPES)
    require("out", out, np.float32, shape=tuple(x.shape))
    table = reader_view(bias, wide=False)
    if table.shape[1] != x.shape[1] or x.shape[0] % table.shape[0]:
        raise ValueError(f"bias: shape {tuple(bias.shape)} does not broadcast over rows of {tuple(x.shape)}")
    if x.size:
        kernel = _add_bias_kernel(storage_of(bias))
        kernel[blocks(ceil_div(x.size, THREADS)), threads(THREADS), stream](x, table, out)
    return out
