"""Embedding gather: token ids -> float32 rows of the (bf16/f16/f32) table."""
from __future__ import annotations

import numpy as np

from moebus.cuda.dtypes import to_f32


def embedding_ref(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    # table (V, D) stored weights; ids (T,) int32 -> (T, D) float32
    return to_f32(table[np.asarray(ids, dtype=np.int64)])
