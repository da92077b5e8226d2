"""Rotary embedding with one position per axis (rotate-half form): frequency ``i`` of a head turns
by the position of axis ``axes[i]`` of its token, ``cos[positions[t, axes[i]], i]``. Two users:

- Qwen3-VL's language model, interleaved M-RoPE: 3 axes (temporal, height, width), the default
  rope tables, ``mrope_axes(head_dim, mrope_section)``;
- its vision tower's 2-D rotary: 2 axes (row, column of the patch), ``vision_rope_tables`` (column
  ``i`` of both halves over the same hd/4 inverse frequencies), ``vision_axes(head_dim)``.

Text tokens have three equal positions, so the op then equals plain RoPE (rope.py). The tower
passes its q or k projection's ``bias`` (H hd,) here, added before the rotation, so that the
projection's output is read and written once (the product itself has no bias then)."""
from __future__ import annotations

import functools

import numpy as np

from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels.compat import blocks, cuda, threads, kernel
from moebus.cuda.kernels.launch import WEIGHT_DTYPES, ceil_div, require
from moebus.cuda.kernels.loads import SCALAR, reader_view, storage_of
from moebus.cuda.kernels.rope import pair_of, rotate_pair

THREADS = 256


def mrope_axes(head_dim: int, section) -> np.ndarray:
    """(hd/2,) int32: 0 temporal, 1 height, 2 width, as transformers' recomposition_frequencies."""
    axes = np.zeros(head_dim // 2, np.int32)
    for axis in (1, 2):
        axes[axis : 3 * int(section[axis]) : 3] = axis
    return axes


def vision_axes(head_dim: int) -> np.ndarray:
    """(hd/2,) int32: the first hd/4 frequencies turn by the patch's row, the rest by its column."""
    quarter = head_dim // 4
    return np.repeat(np.arange(2, dtype=np.int32), quarter)


def vision_rope_tables(head_dim: int, theta: float, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (max_positions, hd/2) float32 for the vision tower: column i uses inverse frequency
    i mod hd/4 of ``1 / theta ** (arange(0, hd/2, 2) / (hd/2))``, as Qwen3VLMoeVisionRotaryEmbedding."""
    spatial = head_dim // 2
    exponent = np.arange(0, spatial, 2, dtype=np.int64).astype(np.float32) / np.float32(spatial)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    freqs = np.arange(max_positions, dtype=np.float32)[:, None] * np.tile(inv_freq, 2)[None, :]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def mrope_ref(x: np.ndarray, positions: np.ndarray, axes: np.ndarray, cos: np.ndarray, sin: np.ndarray,
              bias: np.ndarray | None = None) -> np.ndarray:
    # x (T, H, hd) float32, positions (T, A) int32, axes (hd/2,) int32, bias (H hd,) stored or None
    # -> (T, H, hd) float32: x + bias, rotated
    if bias is not None:
        x = np.asarray(x, np.float32) + to_f32(bias).reshape(x.shape[1:])
    half = x.shape[-1] // 2
    chosen = np.take_along_axis(np.asarray(positions), np.broadcast_to(axes, (len(positions), half)), axis=1)
    columns = np.arange(half)[None, :]
    c = cos[chosen, columns][:, None, :]
    s = sin[chosen, columns][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


# -- cuda -----------------------------------------------------------------------------------------

@functools.cache
def _mrope_kernel(bias_storage: str | None):
    load = SCALAR[bias_storage or "f32"]
    with_bias = bias_storage is not None

    @kernel
    def mrope_flat(x, positions, axes, cos, sin, bias, out):
        # one thread per (token, head, i < half): rotates the pair (i, i + half) (+ their biases) by
        # axis axes[i]'s position
        num_tokens, num_heads, head_dim = x.shape
        half = head_dim // 2
        for n in range(cuda.grid(1), num_tokens * num_heads * half, cuda.gridsize(1)):
            t, h, i = pair_of(n, num_heads, half)
            position = positions[t, axes[i]]
            x1 = x[t, h, i]
            x2 = x[t, h, i + half]
            if with_bias:
                x1 += load(bias, 0, h * head_dim + i)
                x2 += load(bias, 0, h * head_dim + i + half)
            rotate_pair(out, t, h, i, half, x1, x2, cos[position, i], sin[position, i])

    return mrope_flat


def mrope_cuda(x, positions, axes, cos, sin, out, stream=0, bias=None):
    """out (T, H, hd) = mrope_ref(x, positions, axes, cos, sin, bias). Positions must be < the tables'
    rows and axes < positions' columns (the callers build both)."""
    num_tokens, num_heads, head_dim = x.shape
    require("x", x, np.float32, ndim=3)
    require("positions", positions, np.int32, ndim=2)
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} rows for {num_tokens} tokens")
    require("axes", axes, np.int32, shape=(head_dim // 2,))
    require("cos", cos, np.float32, shape=(None, head_dim // 2))
    require("sin", sin, np.float32, shape=tuple(cos.shape))
    require("out", out, np.float32, shape=tuple(x.shape))
    if bias is not None:
        require("bias", bias, WEIGHT_DTYPES, shape=(num_heads * head_dim,))
    total = num_tokens * num_heads * (head_dim // 2)
    if total:
        kernel = _mrope_kernel(None if bias is None else storage_of(bias))
        bias_view = reader_view(bias if bias is not None else cos[0], wide=False)  # never read without bias
        kernel[blocks(ceil_div(total, THREADS)), threads(THREADS), stream](x, positions, axes, cos, sin, bias_view, out)
    return out
