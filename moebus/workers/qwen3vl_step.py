"""What a step carries for Qwen3-VL beyond a plain one, and the stage's two hooks for it:

- **M-RoPE**: ``rope_positions`` (T, 3) int32, the temporal / height / width position of each token
  (an image's tokens sit on a grid; the text after it continues from the grid's largest position
  plus one, so a sequence's rope positions run behind its KV positions, see common/qwen3vl_positions.py).
  Absent, every axis is the token's KV position (a text-only sequence).
- **DeepStack**: ``deepstack`` (L, R, D) float32 at ``deepstack_rows`` (R,): after language-model layer
  ``l < L`` the hidden states of those rows (the image tokens) get ``deepstack[l]`` added."""
from __future__ import annotations

import numpy as np


def check_qwen3vl_arrays(batch) -> None:
    """Raise ValueError unless the batch's Qwen3-VL arrays fit its tokens (normalizes dtypes)."""
    num_tokens = batch.num_tokens
    if batch.rope_positions is not None:
        batch.rope_positions = np.ascontiguousarray(batch.rope_positions, dtype=np.int32)
        if batch.rope_positions.shape != (num_tokens, 3):
            raise ValueError(f"rope_positions {batch.rope_positions.shape}, expected ({num_tokens}, 3)")
        if num_tokens and int(batch.rope_positions.min()) < 0:
            raise ValueError("rope_positions must not be negative")
    if (batch.deepstack is None) != (batch.deepstack_rows is None):
        raise ValueError("deepstack and deepstack_rows come together")
    if batch.deepstack is not None:
        batch.deepstack = np.ascontiguousarray(batch.deepstack, dtype=np.float32)
        batch.deepstack_rows = np.ascontiguousarray(batch.deepstack_rows, dtype=np.int32)
        rows = batch.deepstack_rows
        if batch.deepstack.ndim != 3 or batch.deepstack.shape[1] != len(rows):
            raise ValueError(f"deepstack {batch.deepstack.shape} and deepstack_rows {rows.shape} do not match")
        if len(rows) and (rows.min() < 0 or rows.max() >= num_tokens or len(np.unique(rows)) != len(rows)):
            raise ValueError(f"deepstack_rows must be distinct rows of the step's {num_tokens} tokens")


def qwen3vl_within(batch, first_token: int, count: int) -> dict:
    """The Qwen3-VL arrays of tokens [first_token, first_token + count), renumbered for that piece."""
    out = {}
    if batch.rope_positions is not None:
        out["rope_positions"] = batch.rope_positions[first_token : first_token + count]
    if batch.deepstack is not None:
        inside = (batch.deepstack_rows >= first_token) & (batch.deepstack_rows < first_token + count)
        out.update(deepstack=batch.deepstack[:, inside], deepstack_rows=batch.deepstack_rows[inside] - first_token)
    return out


def rope_positions(batch, token_positions: np.ndarray) -> np.ndarray:
    """(T, 3) int32: the batch's M-RoPE positions, or the token positions on every axis."""
    if batch.rope_positions is not None:
        return batch.rope_positions
    return np.ascontiguousarray(np.repeat(token_positions[:, None], 3, axis=1), dtype=np.int32)


def deepstack_inputs(batch, layers: range) -> dict:
    """The stage inputs for the DeepStack layers this stage holds ({} when none)."""
    if batch.deepstack is None or not len(batch.deepstack_rows) or layers.start >= batch.deepstack.shape[0]:
        return {}
    return {"deepstack": batch.deepstack, "deepstack_rows": batch.deepstack_rows}


def add_deepstack(ops, x, inputs: dict, layer: int):
    """x with ``deepstack[layer]`` added at ``deepstack_rows`` (x: the full hidden states after the
    layer, residual included), as transformers' ``_deepstack_process``."""
    rows = inputs["deepstack_rows"]
    added = ops.add(ops.embedding(x, rows), inputs["deepstack"][layer])
    return ops.scatter_rows(x, rows, added)
