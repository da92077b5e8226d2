"""Element-wise ops: residual add and SwiGLU (silu(gate) * up)."""
from __future__ import annotations

import numpy as np


def add_ref(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (np.asarray(x, dtype=np.float32) + np.asarray(y, dtype=np.float32)).astype(np.float32)


def silu_ref(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu_ref(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    # gate, up (T, I) float32 -> (T, I) float32
    return silu_ref(gate) * np.asarray(up, dtype=np.float32)
