"""A Qwen3-VL prompt's image tokens and M-RoPE positions, as transformers' ``Qwen3VLProcessor``
(``<|image_pad|>`` expanded to each image's token count) and ``Qwen3VLMoeModel.get_rope_index`` make
them. Text tokens get three equal positions counting on from the last one; an image's tokens sit on
its merged grid, temporal position = start, height = start + row, width = start + column, and the
text after it continues from start + max(rows, columns). The positions after the prompt (the
generated tokens) are the token's index plus ``delta = max position + 1 - prompt length`` (<= 0)."""
from __future__ import annotations

import numpy as np


def expand_image_pads(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """The i-th ``<|image_pad|>`` becomes ``counts[i]`` of them (the caller checked that the prompt
    holds exactly len(counts))."""
    out: list[int] = []
    images = iter(counts)
    for token in ids:
        out.extend([token] * next(images) if token == image_token_id else (token,))
    return out


def rope_index(ids, image_token_id: int, grids: list[tuple[int, int]], merge_size: int) -> tuple[np.ndarray, int]:
    """((len(ids), 3) int32 positions, delta) of an expanded prompt; ``grids``: (grid_h, grid_w) in
    patches per image, in order. Raises ValueError when the image tokens do not match the grids."""
    ids = np.asarray(ids)
    positions = np.zeros((len(ids), 3), np.int64)
    is_image = ids == image_token_id
    current, i, image = 0, 0, 0
    while i < len(ids):
        if not is_image[i]:
            run = i + 1
            while run < len(ids) and not is_image[run]:
                run += 1
            positions[i:run] = current + np.arange(run - i)[:, None]
            current += run - i
            i = run
            continue
        if image >= len(grids):
            raise ValueError(f"more image tokens than the {len(grids)} image(s) account for")
        rows, cols = grids[image][0] // merge_size, grids[image][1] // merge_size
        count = rows * cols
        if not is_image[i : i + count].all() or len(is_image[i : i + count]) != count:
            raise ValueError(f"image {image} needs {count} consecutive image tokens")
        h, w = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        positions[i : i + count, 0] = current
        positions[i : i + count, 1] = current + h.ravel()
        positions[i : i + count, 2] = current + w.ravel()
        current += max(rows, cols)
        i += count
        image += 1
    if image != len(grids):
        raise ValueError(f"{image} image(s) in the prompt for {len(grids)} grid(s)")
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions.astype(np.int32), delta


def step_rope_positions(prompt_positions: np.ndarray | None, delta: int, start: int, length: int) -> np.ndarray:
    """(length, 3) int32 positions of tokens [start, start + length) of a sequence: the prompt's own
    inside the prompt, index + delta after it (the generated tokens)."""
    index = np.arange(start, start + length)
    out = np.repeat((index + delta)[:, None], 3, axis=1)
    if prompt_positions is not None:
        inside = index < len(prompt_positions)
        out[inside] = prompt_positions[index[inside]]
    return out.astype(np.int32)
