"""Rotary position embedding, rotate-half (GPT-NeoX) form as Qwen3-MoE and Mixtral use it."""
from __future__ import annotations

import numpy as np


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
