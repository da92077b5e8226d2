"""The attention projections in FP8 (setting ``attention.dtype`` fp8, env MOEBUS_ATTENTION__DTYPE): each
of q, k, v, o as e4m3 codes (R, C) and a float32 scale per row and 128 inputs (the 128 x 128 block
grid repeated for each row of a block), what ``cuda/kernels/linear_quant.py`` reads. An FP8 checkpoint
keeps its own codes and scales; a bf16 one is quantized at load (round to nearest, as the experts).

Per-row scales cost 4 bytes per 128 codes; in exchange q, k and v concatenate into the fused qkv
projection (``concat_rows``) whatever their row counts, with every weight exactly as stored.

The lm_head the same way (setting ``lm_head.dtype`` fp8, env MOEBUS_LM_HEAD__DTYPE): ``lm_head_fp8``."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from moebus.common.arch import ATTN, GLOBAL, LAYER
from moebus.common.errors import CheckpointError
from moebus.common.quant import BLOCK, fp8_quantize

ATTENTION_DTYPES = ("bf16", "fp8")
LM_HEAD_DTYPES = ("bf16", "fp8")
PROJECTIONS = ("q", "k", "v", "o")
QUANTIZE_THREADS = min(8, os.cpu_count() or 1)  # numpy releases the GIL: an A3B layer's 19 M weights in parallel
ROWS_PER_TASK = 4 * BLOCK  # whole block rows, so the pieces' scales are the whole matrix's


def row_scales(block_scales: np.ndarray, rows: int) -> np.ndarray:
    """(R, G) float32: the block grid (ceil(R/128), G) with each block row repeated for its rows."""
    return np.ascontiguousarray(np.repeat(np.asarray(block_scales, np.float32), BLOCK, axis=0)[:rows])


def fp8_rows(w: np.ndarray, pool: ThreadPoolExecutor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(codes (R, C) uint8, scales (R, G) float32) of a matrix (float32, or a weight as stored: bf16
    bits, f16), on the 128 x 128 block grid; with ``pool``, pieces of ROWS_PER_TASK rows in parallel.
    Each piece is made float32 on its own, so a stored lm_head never has a whole float32 copy (1.2 GB
    for a 151,936-token vocabulary at hidden 2,048)."""
    from moebus.cuda.dtypes import to_f32

    if pool is None or w.shape[0] <= ROWS_PER_TASK:
        codes, block_scales = fp8_quantize(to_f32(w))
        return codes, row_scales(block_scales, codes.shape[0])
    pieces = list(pool.map(fp8_rows, [w[r : r + ROWS_PER_TASK] for r in range(0, w.shape[0], ROWS_PER_TASK)]))
    return concat_rows(pieces)


def concat_rows(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One FP8 weight whose rows are those of ``parts`` in order (the fused qkv projection)."""
    return np.concatenate([c for c, _ in parts]), np.concatenate([s for _, s in parts])


def attention_fp8(ckpt, layer: int, tensors: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{q, k, v, o: (codes, scales)} of a layer: the checkpoint's own FP8 codes and block scales where
    it stores them so, else ``tensors`` (the bf16 weights ckpt.attention gave) quantized."""
    from moebus.cuda.dtypes import to_f32

    out = {}
    with ThreadPoolExecutor(QUANTIZE_THREADS) as pool:
        for key in PROJECTIONS:
            stored = ckpt.fp8_tensor(LAYER.format(i=layer) + ATTN[key])
            if stored is None:
                out[key] = fp8_rows(to_f32(tensors[key]), pool)
                continue
            codes, block_scales = stored  # ckpt.attention checked their shape against the config
            out[key] = np.ascontiguousarray(codes), row_scales(block_scales, codes.shape[0])
    return out


def fp8_rows_nbytes(rows: int, cols: int) -> int:
    """Bytes of an FP8 weight (R, C) as fp8_rows makes it: a code a weight, a float32 scale per row
    and 128 inputs."""
    return rows * cols + rows * -(-cols // BLOCK) * 4


def lm_head_fp8(ckpt) -> tuple[np.ndarray, np.ndarray]:
    """The lm_head as (codes, scales): an FP8 checkpoint's own codes and block scales where it stores
    the lm_head so (most leave it unconverted: ``modules_to_not_convert``), else the stored weight
    quantized at load. A tied lm_head is a quantized copy of the embedding table, which the first
    stage still reads as stored."""
    name = GLOBAL["lm_head"]
    if not ckpt.config.tie_word_embeddings and ckpt.has(name):
        stored = ckpt.fp8_tensor(name)
        if stored is not None:
            codes, block_scales = stored
            expected = (ckpt.config.vocab_size, ckpt.config.hidden_size)
            if tuple(codes.shape) != expected:
                raise CheckpointError(f"{ckpt.dir}: {name} has shape {tuple(codes.shape)}, config implies {expected}")
            return np.ascontiguousarray(codes), row_scales(block_scales, codes.shape[0])
    with ThreadPoolExecutor(QUANTIZE_THREADS) as pool:
        return fp8_rows(ckpt.lm_head(), pool)
