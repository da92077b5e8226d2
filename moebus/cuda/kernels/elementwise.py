"""Element-wise ops: residual add and SwiGLU (silu(gate) * up), plus fill (zeros, test poison)."""
from __future__ import annotations

import math

import numpy as np

from moebus.cuda.kernels.compat import blocks, cuda, float32, threads, kernel
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import ceil_div, require

THREADS = 256


def add_ref(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (np.asarray(x, dtype=np.float32) + np.asarray(y, dtype=np.float32)).astype(np.float32)


def silu_ref(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu_ref(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    # gate, up (T, I) float32 -> (T, I) float32
    return silu_ref(gate) * np.asarray(up, dtype=np.float32)


# -- cuda -----------------------------------------------------------------------------------------

@kernel
def add_flat(x, y, out):
    grid_dependency_wait()  # pdl.py: before any global read or write
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[i] = x[i] + y[i]


@kernel
def swiglu_flat(gate, up, out):
    grid_dependency_wait()  # pdl.py: before any global read or write
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        g = gate[i]
        out[i] = g / (float32(1.0) + math.exp(-g)) * up[i]


@kernel
def fill_flat(out, value):
    grid_dependency_wait()  # pdl.py: before any global read or write
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[i] = value


def _flat(array):
    return array.reshape(array.size)


def _grid(size: int):
    return blocks(ceil_div(size, THREADS)), threads(THREADS)


def _binary(kernel, x, y, out, stream):
    require("x", x, np.float32)
    require("y", y, np.float32, shape=tuple(x.shape))
    require("out", out, np.float32, shape=tuple(x.shape))
    if x.size:
        grid, block = _grid(x.size)
        kernel[grid, block, stream](_flat(x), _flat(y), _flat(out))
    return out


def add_cuda(x, y, out, stream=0):
    """out = x + y (float32, same shape)."""
    return _binary(add_flat, x, y, out, stream)


def swiglu_cuda(gate, up, out, stream=0):
    """out = silu(gate) * up (float32, same shape)."""
    return _binary(swiglu_flat, gate, up, out, stream)


def fill_cuda(out, value, stream=0):
    """Every element of the C-contiguous device array ``out`` = value (in its dtype)."""
    require("out", out)
    if out.size:
        grid, block = _grid(out.size)
        fill_flat[grid, block, stream](_flat(out), np.dtype(out.dtype).type(value))
    return out
