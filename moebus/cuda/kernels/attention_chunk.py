"""The attention of a routed step whose rows come in runs of one sequence (a prompt's chunk beside
decode rows): the parts around the tensor-core kernel (attention_chunk_tc.py), which reads a run's keys
once for all its rows where the decode kernel (attention_decode.py) reads them again for every row.

The step's rows are cut into tiles: consecutive rows of one sequence at ascending positions, at most
``attention_chunk_tc.tile_rows(group)`` of them (64 (row, query head) pairs). A tile table
(num_tiles, 3) int32 (first row, rows, KV slot) is a step input built on the host (``chunk_tiles``);
its size depends on the step's tokens and sequences only, so a captured step keeps its grid while its
chunk moves; tiles of 0 rows exit at once. Tiles of one row (decode rows) run on the decode kernel,
which streams one row's keys at HBM speed: ``decode_positions`` gives it their positions and 0 for a
chunk's rows (a block per kv head over key 0, overwritten). The tensor-core kernel takes the tiles of
2 rows or more and writes their splits' partials in the decode kernel's scratch layout (splits of
its own size, attention_chunk_tc.SPLIT_KEYS); ``merge_tile_splits`` combines a row's splits in order.
A row sees keys <= its position (causal; no sliding window: such models keep the decode kernel).

A numba tile kernel (CUDA cores, a tile's keys in shared memory; MOEBUS_CHUNK_ATTENTION=1) was here
until the eleventh session: on an H200 (tenth session, captured) it was 2.0-2.7x slower than the
decode kernel; git history keeps it."""
from __future__ import annotations

import math

import numpy as np

from moebus.cuda.kernels import attention_chunk_tc
from moebus.cuda.kernels.attention import attention_ref, attention_scratch_shape, require_caches, words
from moebus.cuda.kernels.attention_decode import MAX_SPLITS, NEG_INF, decode_kernel, split_range
from moebus.cuda.kernels.compat import blocks, cuda, float32, kernel, threads
from moebus.cuda.kernels.launch import ceil_div, require

THREADS = 256  # the merge's


def max_tiles(num_tokens: int, num_seqs: int, rows: int) -> int:
    """Tiles a step of num_tokens rows in num_seqs sequences can need at ``rows`` rows a tile
    (ceil(L / rows) <= 1 + (L - 1) // rows, summed over the sequences)."""
    return num_seqs + (num_tokens - num_seqs) // rows


def chunk_tiles(segments, num_tokens: int, rows: int) -> np.ndarray:
    """The tile table (max_tiles, 3) int32 of a step's sequences, ``segments`` its (first row, slot,
    start, length) tuples (stage._segments); unused tiles are (0, 0, 0)."""
    tiles = np.zeros((max_tiles(num_tokens, len(segments), rows), 3), np.int32)
    n = 0
    for first_row, slot, _, length in segments:
        for offset in range(0, length, rows):
            tiles[n] = first_row + offset, min(rows, length - offset), slot
            n += 1
    return tiles


def check_tiles(tiles: np.ndarray, token_slot: np.ndarray, token_pos: np.ndarray, max_rows: int) -> None:
    """Every row in exactly one tile, of the tile's slot, at ascending positions; else ValueError."""
    tiles, token_slot, token_pos = (np.asarray(a) for a in (tiles, token_slot, token_pos))
    if tiles.ndim != 2 or tiles.shape[1] != 3:
        raise ValueError(f"a tile table is (tiles, 3), not {tiles.shape}")
    seen = np.zeros(len(token_pos), np.int32)
    for first, rows, slot in tiles:
        if not 0 <= rows <= max_rows or first < 0 or first + rows > len(token_pos):
            raise ValueError(f"tile (first {first}, rows {rows}) outside the step's {len(token_pos)} rows")
        seen[first:first + rows] += 1
        if np.any(token_slot[first:first + rows] != slot) or np.any(np.diff(token_pos[first:first + rows]) <= 0):
            raise ValueError(f"tile (first {first}, rows {rows}): rows of slot {slot} at ascending positions")
    if np.any(seen != 1):
        raise ValueError("a tile table must hold every row of the step exactly once")


def attention_tiles_ref(q, k_cache, v_cache, tiles, token_slot, token_pos, scale: float) -> np.ndarray:
    """The reference: per tile, its rows against its slot's keys [0, pos] (float32); the table is
    checked against the tensor-core kernel's rows a tile."""
    check_tiles(tiles, token_slot, token_pos, attention_chunk_tc.tile_rows(q.shape[1] // k_cache.shape[1]))
    out = np.empty_like(q, dtype=np.float32)
    for first, rows, slot in np.asarray(tiles):
        if rows:
            rows_at = slice(first, first + rows)
            out[rows_at] = attention_ref(q[rows_at], k_cache, v_cache, np.full(rows, slot, np.int32),
                                         np.asarray(token_pos)[rows_at], scale)
    return out


@kernel
def merge_tile_splits(tiles, max_rows, token_pos, split_positions, partial, out):
    # one thread per output (tile, row, h, d): the tile's splits combined in order (deterministic);
    # a tile of 2+ rows has splits of at least split_positions keys (the tensor-core kernel's), a decode row the
    # decode kernel's
    num_tiles = tiles.shape[0]
    _, num_heads, head_dim = out.shape
    per_row = num_heads * head_dim
    for n in range(cuda.grid(1), num_tiles * max_rows * per_row, cuda.gridsize(1)):
        tile, r = n // (max_rows * per_row), (n // per_row) % max_rows
        first_row, rows = tiles[tile, 0], tiles[tile, 1]
        if r >= rows:
            continue
        t, h, d = first_row + r, (n // head_dim) % num_heads, n % head_dim
        count = token_pos[first_row + rows - 1] + 1
        num_splits = split_range(0, count - 1, 0)[2] if rows == 1 else \
            min(MAX_SPLITS, (count + split_positions - 1) // split_positions)
        peak = NEG_INF
        for s in range(num_splits):
            peak = max(peak, partial[t, h, s, head_dim])
        total = float32(0.0)
        value = float32(0.0)
        for s in range(num_splits):
            weight = math.exp(partial[t, h, s, head_dim] - peak)
            total += partial[t, h, s, head_dim + 1] * weight
            value += partial[t, h, s, d] * weight
        out[t, h, d] = value / total


@kernel
def decode_positions(tiles, max_rows, token_pos, out):
    # out[t]: row t's position where its tile has one row (a decode row), else 0 (one key: the decode
    # kernel's work for a chunk row is a block per kv head over key 0, overwritten by the merge)
    for n in range(cuda.grid(1), tiles.shape[0] * max_rows, cuda.gridsize(1)):
        first_row, rows = tiles[n // max_rows, 0], tiles[n // max_rows, 1]
        if n % max_rows < rows:
            out[first_row + n % max_rows] = token_pos[first_row] if rows == 1 else 0


def attention_tiles_cuda(q, k_cache, v_cache, tiles, token_slot, token_pos, scale: float, out, scratch=None,
                         decode_pos=None, stream=0):
    """out (T, H, hd) = attention_tiles_ref(...) on device arrays (the table is not checked here: the
    stage builds it, chunk_tiles, with attention_chunk_tc.tile_rows rows a tile). Tiles of one row
    (decode rows) run on the decode kernel, as in a step without a chunk (same splits, same bits); the
    others on the tensor-core kernel (attention_chunk_tc.py: bf16 caches, a GPU); one merge. Every
    row's own position must already be in the cache. ``scratch``: float32 of
    attention.attention_scratch_shape, ``decode_pos``: (T,) int32 (each allocated here when None).
    ``stream``: a numba stream or a GraphBuilder (the tensor-core launch takes a stream object, not 0)."""
    num_tokens, num_heads, head_dim = q.shape
    require("q", q, np.float32, ndim=3)
    storage = require_caches(k_cache, v_cache, head_dim=head_dim)
    require("tiles", tiles, np.int32, shape=(None, 3))
    require("token_slot", token_slot, np.int32, shape=(num_tokens,))
    require("token_pos", token_pos, np.int32, shape=(num_tokens,))
    require("out", out, np.float32, shape=tuple(q.shape))
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} kv heads")
    if num_tokens == 0 or tiles.shape[0] == 0:
        return out
    group = num_heads // num_kv_heads
    if storage != "bf16":
        raise ValueError(f"the tensor-core chunk attention reads bf16 caches, not {storage}")
    context = k_cache.shape[2]
    scratch_shape = attention_scratch_shape(num_tokens, num_heads, head_dim, context)
    if scratch is None:
        scratch = cuda.device_array(scratch_shape, np.float32, stream=stream)
    require("scratch", scratch, np.float32, shape=scratch_shape)
    if decode_pos is None:
        decode_pos = cuda.device_array(num_tokens, np.int32, stream=stream)
    require("decode_pos", decode_pos, np.int32, shape=(num_tokens,))
    max_rows = attention_chunk_tc.tile_rows(group)
    grid = blocks(ceil_div(tiles.shape[0] * max_rows, THREADS))
    decode_positions[grid, threads(THREADS), stream](tiles, max_rows, token_pos, decode_pos)
    k_words, v_words, scale = words(k_cache), words(v_cache), np.float32(scale)
    decode, num_threads = decode_kernel(storage, head_dim, group)
    decode[(num_tokens, num_kv_heads, scratch_shape[2]), num_threads, stream](
        q, k_words, v_words, num_kv_heads, context, token_slot, decode_pos, scale, 0, scratch)
    split_keys = attention_chunk_tc.SPLIT_KEYS
    attention_chunk_tc.launch(q, k_cache, v_cache, tiles, token_pos, scale, scratch, stream, split_keys)
    merge_tile_splits[blocks(ceil_div(tiles.shape[0] * max_rows * num_heads * head_dim, THREADS)), threads(THREADS),
                      stream](tiles, max_rows, token_pos, split_keys, scratch, out)
    return out
