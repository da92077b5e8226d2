"""Linear layer without bias: y = x @ W^T with W in the Hugging Face (out, in) layout, fp32 accumulation."""
from __future__ import annotations

import numpy as np

from moebus.cuda.dtypes import to_f32


def linear_ref(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    # x (T, K) float32, weight (N, K) stored -> (T, N) float32
    return np.asarray(x, dtype=np.float32) @ to_f32(weight).T
