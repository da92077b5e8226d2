"""RMSNorm over the last axis, also used per head for Qwen3's q/k norm (rows = tokens x heads)."""
from __future__ import annotations

import numpy as np

from moebus.cuda.dtypes import to_f32


def rmsnorm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x (R, D) float32, weight (D,) stored -> (R, D) float32; as transformers: w * (x * rsqrt(mean(x^2) + eps))
    x = np.asarray(x, dtype=np.float32)
    variance = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return to_f32(weight) * (x * (1.0 / np.sqrt(variance + np.float32(eps))).astype(np.float32))
