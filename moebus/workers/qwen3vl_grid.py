"""Host-side tables of one image's patch grid for Qwen3-VL's tower, in the order the processor
lays the patches out (merge windows of m x m patches together, windows row-major): each patch's
(row, column) for the 2-D rotary, and the four corners and weights that resample the square table of
learned position embeddings to the grid (bilinear, align_corners=True, transformers'
``get_vision_interpolation_indices_and_weights``). Both depend on the grid only, so they are kept
per grid size."""
from __future__ import annotations

from functools import lru_cache

import numpy as np


def patch_rows_cols(grid_h: int, grid_w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) int64 of each patch in merge-window order."""
    within = np.arange(grid_h * grid_w)
    blocks_w = grid_w // merge
    in_col = within % merge
    in_row = (within // merge) % merge
    block_col = (within // (merge * merge)) % blocks_w
    block_row = within // (merge * merge * blocks_w)
    return block_row * merge + in_row, block_col * merge + in_col


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped into the table) and weights along one axis."""
    index = index.astype(np.float32)
    src = index * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets.astype(np.int64), 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets)
    return taps, np.maximum(np.float32(1.0) - distance, np.float32(0.0)).astype(np.float32)


@lru_cache(maxsize=64)
def grid_tables(grid_h: int, grid_w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rope positions (N, 2) int32 row/col, interpolation indices (N, 4) int32, weights (N, 4)
    float32) of a grid_h x grid_w patch grid over a side x side position table."""
    rows, cols = patch_rows_cols(grid_h, grid_w, merge)
    h_taps, h_weights = _axis_taps(rows, grid_h, side)
    w_taps, w_weights = _axis_taps(cols, grid_w, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    tables = (np.stack([rows, cols], axis=1).astype(np.int32), indices.astype(np.int32), weights.astype(np.float32))
    for table in tables:
        table.setflags(write=False)  # shared by every encode of this grid size
    return tables
