"""Weight dtypes. moebus keeps bf16 weights as numpy uint16 arrays holding the bf16 bit patterns
(numpy has no bf16): a uint16 *weight* array always means bf16. Kernels convert in registers."""
from __future__ import annotations

import numpy as np

STORAGE = {"bf16": np.dtype(np.uint16), "f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even (what torch's .to(torch.bfloat16) does for finite values; the uint32
    sum cannot overflow for them: the largest finite pattern plus 0x8000 is below 2**32)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (u >> 16) & 1
    rounded += 0x7FFF
    rounded += u
    rounded >>= 16
    return rounded.astype(np.uint16)


def to_f32(weights: np.ndarray) -> np.ndarray:
    """Any stored weight (bf16 bits, f16, f32) as float32."""
    if weights.dtype == np.uint16:
        return bf16_to_f32(weights)
    return np.asarray(weights, dtype=np.float32)


def storage_name(weights: np.ndarray) -> str:
    for name, dtype in STORAGE.items():
        if weights.dtype == dtype:
            return name
    raise TypeError(f"unsupported weight dtype {weights.dtype}")
