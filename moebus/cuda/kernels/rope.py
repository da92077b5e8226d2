"""Rotary position embedding, rotate-half (GPT-NeoX) form as Qwen3-MoE and Mixtral use it."""
from __future__ import annotations

import numpy as np

from moebus.cuda.kernels.compat import blocks, cuda, device, kernel, threads
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import ceil_div, require

THREADS = 256


def rope_tables(head_dim: int, theta: float, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (max_positions, head_dim // 2), float32, computed as transformers does
    (inv_freq in float32, position * inv_freq in float32) so that positions match bit for bit."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    freqs = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def rope_ref(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x (T, H, hd) float32, positions (T,) int32 -> (T, H, hd) float32
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


# -- cuda -----------------------------------------------------------------------------------------

@device
def pair_of(n, num_heads, half):
    """(token, head, i < half) of flat pair index n: the pair (i, i + half) of that head's row."""
    per_token = num_heads * half
    return n // per_token, (n % per_token) // half, n % half


@device
def rotate_pair(out, t, h, i, half, x1, x2, c, s):
    out[t, h, i] = x1 * c - x2 * s
    out[t, h, i + half] = x2 * c + x1 * s


@kernel
def rope_flat(x, positions, cos, sin, out):
    # one thread per (token, head, i < half): rotates the pair (i, i + half)
    grid_dependency_wait()  # pdl.py: before any global read or write
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    for n in range(cuda.grid(1), num_tokens * num_heads * half, cuda.gridsize(1)):
        t, h, i = pair_of(n, num_heads, half)
        position = positions[t]
        rotate_pair(out, t, h, i, half, x[t, h, i], x[t, h, i + half], cos[position, i], sin[position, i])


def rope_cuda(x, positions, cos, sin, out, stream=0):
    """out (T, H, hd) = rope_ref(x, positions, cos, sin); cos, sin (max_positions, hd // 2) float32.
    Positions must be < max_positions (the stage checks max_context before the step)."""
    num_tokens, num_heads, head_dim = x.shape
    require("x", x, np.float32, ndim=3)
    require("positions", positions, np.int32, shape=(num_tokens,))
    require("cos", cos, np.float32, shape=(None, head_dim // 2))
    require("sin", sin, np.float32, shape=tuple(cos.shape))
    require("out", out, np.float32, shape=tuple(x.shape))
    total = num_tokens * num_heads * (head_dim // 2)
    if total:
        rope_flat[blocks(ceil_div(total, THREADS)), threads(THREADS), stream](x, positions, cos, sin, out)
    return out
