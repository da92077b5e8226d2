"""A prompt's chunk beside decode rows, its attention on tensor cores (attention_chunk_tc.cu): the
tile step of attention_chunk.attention_tiles_cuda where the cache is bf16.

Why: on the decode kernel each of a chunk's rows reads and unpacks its sequence's whole context
again, and a numba tile kernel on CUDA cores measured 2.1-2.6x slower still (H200, ninth session;
removed in the eleventh). Here a block takes BM = 64 (row, query head) pairs of one kv head (BM / group rows of one
sequence: 8 at A3B's group of 8) over one split of the tile's keys, on flash_attention.cu's mma.sync
products (split bf16 parts, fp32 sums): each key is read once for all of them. The tile table
comes from the device (the step input ``attn_tiles``), the grid is (tiles, kv heads, splits) sized
for the most a step can hold, and blocks past the table's tiles or the tile's splits exit, so a
captured step follows its chunk.

Splits: of at least SPLIT_KEYS keys (at most attention_decode.MAX_SPLITS), fewer and longer than
the decode kernel's, so a block's query load and partial stores are spread over more keys; the merge
(attention_chunk.merge_tile_splits) is told the same. The reference is attention_chunk's
(attention_tiles_ref); the simulator and fp32 caches keep the decode kernel (``ready``)."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np

from moebus.cuda.kernels import flash_attention
from moebus.cuda.kernels.attention_decode import MAX_SPLITS
from moebus.cuda.kernels.launch import ceil_div

log = logging.getLogger("moebus.cuda")
SOURCE = Path(__file__).with_suffix(".cu")
INCLUDE = b'#include "flash_attention.cu"'
ENTRY = "chunk_attention"
WARPS = 4  # the .cu's WARPS: 16 pairs a warp
BLOCK_PAIRS = 16 * WARPS  # the .cu's BM
SPLIT_KEYS = int(os.environ.get("MOEBUS_CHUNK_TC_SPLIT_KEYS", "256"))


def tile_rows(group: int) -> int:
    """Rows of one sequence a tile holds at ``group`` query heads per kv head (0: none fit)."""
    return BLOCK_PAIRS // group if group > 0 else 0


def num_splits(context: int, split_keys: int | None = None) -> int:
    """Splits a tile's keys [0, last position] of ``context`` positions can take: the grid's z."""
    return min(MAX_SPLITS, ceil_div(context, split_keys or SPLIT_KEYS))


def source() -> bytes:
    """The kernel's CUDA C++: this .cu with flash_attention's source (its device functions) in place
    of its #include."""
    main = SOURCE.read_bytes()
    if INCLUDE not in main:
        raise RuntimeError(f"{SOURCE.name} lacks {INCLUDE.decode()}")
    return main.replace(INCLUDE, flash_attention.source(), 1)


def compile_options(head_dim: int, arch: str) -> list[bytes]:
    return flash_attention.compile_options(head_dim, False, arch, WARPS)


def cubin(head_dim: int, arch: str, cache_dir: str | None) -> bytes:
    """The cubin for ``arch``, from ``cache_dir``/attention_chunk_tc when compiled before (the name
    hashes the source, the options and NVRTC's version), else NVRTC's, then kept there."""
    return flash_attention.cached_cubin(source(), compile_options(head_dim, arch), cache_dir, "attention_chunk_tc")


@functools.cache
def _kernel(head_dim: int):
    from moebus.cuda.kernels.compat import _numba_config, cuda

    gpu = cuda.get_current_device()
    flash_attention._core_device(gpu.id).set_current()  # the primary context, numba's own
    major, minor = gpu.compute_capability
    code = cubin(head_dim, f"sm_{major}{minor}", _numba_config.CACHE_DIR)
    return flash_attention._object_code().from_cubin(code, name=f"chunk_attention_hd{head_dim}").get_kernel(ENTRY)


def ready(head_dim: int, group: int, storage: str) -> bool:
    """Whether this kernel takes a bf16 cache's chunks on this device: a GPU (not the simulator),
    flash attention's head dims, a tile of at least 2 rows, and the kernel built (a failure warns
    once: the decode kernel takes the chunk's rows)."""
    return storage == "bf16" and tile_rows(group) >= 2 and flash_attention.supported(head_dim) and _builds(head_dim)


@functools.cache
def _builds(head_dim: int) -> bool:
    try:
        _kernel(head_dim)
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: the decode kernel still works
        log.warning("chunk attention on tensor cores unavailable for head dim %d (%s)", head_dim, exc)
        return False
    return True


def launch(q, k_cache, v_cache, tiles, token_pos, scale: float, scratch, stream, split_keys: int) -> None:
    """The partials of every tile of 2 rows or more into ``scratch`` (attention_scratch_shape's):
    their split s of [0, last row's position] (num_splits(., split_keys)) at [t, h, s]. Shapes are
    checked by attention_chunk.attention_tiles_cuda. ``stream``: a numba stream or a GraphBuilder
    (not 0: a cuda.core launch takes a stream object)."""
    if not hasattr(stream, "__cuda_stream__"):
        raise ValueError("the tensor-core chunk attention launches on a stream object, not the default stream 0")
    num_tokens, heads, head_dim = q.shape
    _, kv_heads, context, _ = k_cache.shape
    grid = (tiles.shape[0], kv_heads, num_splits(context, split_keys))
    ptr = flash_attention._pointer
    flash_attention._core_launch(stream, grid, 32 * WARPS, _kernel(head_dim), ptr(q), ptr(k_cache), ptr(v_cache),
                                 ptr(scratch), ptr(tiles), ptr(token_pos), np.int32(heads), np.int32(kv_heads),
                                 np.int32(context), np.int32(heads // kv_heads), np.int32(scratch.shape[2]),
                                 np.int32(split_keys), np.int32(MAX_SPLITS), np.float32(scale * np.log2(np.e)))


def partials_ref(q, k_cache, v_cache, tiles, token_pos, scale: float, scratch_splits: int, split_keys: int):
    """What ``launch`` writes, in numpy (float64 sums): (T, H, scratch_splits, hd + 2) float32, NaN
    where it writes nothing; for each pair of a tile of 2+ rows and each split s of its tile's keys:
    sum_j e^(s_j - m) v_j, m (the split's largest score, -inf where the row sees none of its keys), and
    sum_j e^(s_j - m), over the keys j of the split the row sees (j <= its position)."""
    from moebus.cuda.dtypes import bf16_to_f32

    num_tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = np.full((num_tokens, heads, scratch_splits, head_dim + 2), np.nan, np.float32)
    for first_row, rows, slot in np.asarray(tiles):
        if rows < 2:
            continue
        count = int(token_pos[first_row + rows - 1]) + 1
        splits = min(MAX_SPLITS, ceil_div(count, split_keys))
        keys = bf16_to_f32(k_cache[slot]).astype(np.float64)  # (KVH, C, hd)
        values = bf16_to_f32(v_cache[slot]).astype(np.float64)
        for t in range(first_row, first_row + rows):
            for h in range(heads):
                scores = keys[h // group, :count] @ q[t, h].astype(np.float64) * scale
                for s in range(splits):
                    lo, hi = s * count // splits, min((s + 1) * count // splits, int(token_pos[t]) + 1)
                    if hi <= lo:
                        out[t, h, s, :head_dim], out[t, h, s, head_dim:] = 0.0, (-np.inf, 0.0)
                        continue
                    peak = scores[lo:hi].max()
                    weights = np.exp(scores[lo:hi] - peak)
                    out[t, h, s, :head_dim] = weights @ values[h // group, lo:hi]
                    out[t, h, s, head_dim:] = peak, weights.sum()
    return out
