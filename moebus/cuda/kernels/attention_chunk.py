"""The attention of a routed step whose rows come in runs of one sequence (a prompt's chunk beside
decode rows): the keys and values a run reads are loaded once into shared memory and used by all its
rows, where the decode kernel (attention_decode.py) reads them again for every row.

The step's rows are cut into tiles: consecutive rows of one sequence at ascending positions, at most
``rows_per_tile(group, head_dim)`` of them. A tile table (num_tiles, 3) int32 (first row, rows, KV
slot) is a step input built on the host (``chunk_tiles``); its size depends on the step's tokens and
sequences only, so a captured step keeps its grid while its chunk moves; tiles of 0 rows exit at once.
Tiles of one row (decode rows) run on the decode kernel, which streams one row's keys at HBM speed:
``decode_positions`` gives it their positions and 0 for a chunk's rows (a block per kv head over key 0,
overwritten). The tile kernel takes the tiles of 2 rows or more: one block per (tile, kv head, split):
the tile's keys [0, pos of its last row] are cut into splits as the decode kernel cuts one token's
(split_range), so the scratch has its layout; ``merge_tile_splits`` combines a row's splits in order. A
block holds its (row, query head) pairs' scaled queries in shared memory and walks its split WARP keys
at a time, flash-attention style: the keys are unpacked to float32 into shared memory, each warp takes
some pairs, a lane computes the whole dot product of one key with each of its warp's pairs (no shuffle
per key), the warp's max and sum per pair are two shuffle reductions per WARP keys; then the values
replace the keys in shared memory and a lane accumulates hd / WARP output elements of each pair over
the WARP keys. A row sees keys <= its position (causal; no sliding window: such models keep the decode
kernel). Measured on an H200 (tenth session, captured) this numba kernel is 2.0-2.7x slower than the
decode kernel; ``kernel="tc"`` runs the tiles on tensor cores instead (attention_chunk_tc.py: 64
(row, head) pairs a tile, splits of its own size, told to the merge), the stage's default."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.attention import attention_ref, attention_scratch_shape, require_caches, words
from moebus.cuda.kernels.attention_decode import MAX_SPLITS, NEG_INF, QUAD, SPLIT_POSITIONS, decode_kernel, split_range
from moebus.cuda.kernels.compat import SIMULATOR, WARP, blocks, cuda, float32, kernel, threads, warp_max, warp_sum
from moebus.cuda.kernels.launch import ceil_div, require

MAX_PAIRS = 64  # (row, query head) pairs of a tile, at most
WARPS = 2 if SIMULATOR else 8
SHARED_BYTES = 44 * 1024  # queries + a key tile + probabilities (static shared memory is 48 KiB at most)
THREADS = 256  # the merge's
KERNELS = ("numba", "tc")  # the tile step's kernels (attention_tiles_cuda)


def _shared_bytes(pairs: int, head_dim: int) -> int:
    # scaled queries (pairs, hd), a key (or value) tile (WARP, hd + 1: no bank conflicts), probabilities
    return 4 * (pairs * head_dim + WARP * (head_dim + 1) + pairs * WARP)


def rows_per_tile(group: int, head_dim: int) -> int:
    """Rows of one sequence a tile holds, for ``group`` query heads per kv head (its pairs' queries
    and a key tile fit SHARED_BYTES); 0 where not even one row fits (such models keep the decode kernel)."""
    fit = (SHARED_BYTES - 4 * WARP * (head_dim + 1)) // (4 * (head_dim + WARP))
    return min(MAX_PAIRS, fit) // group


def tile_rows(kernel: str, group: int, head_dim: int) -> int:
    """Rows a tile holds for ``kernel`` ("numba": rows_per_tile, "tc": attention_chunk_tc's 64 pairs)."""
    if kernel == "tc":
        from moebus.cuda.kernels.attention_chunk_tc import tile_rows as tc_rows

        return tc_rows(group)
    return rows_per_tile(group, head_dim)


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


def attention_tiles_ref(q, k_cache, v_cache, tiles, token_slot, token_pos, scale: float,
                        kernel: str = "numba") -> np.ndarray:
    """The reference: per tile, its rows against its slot's keys [0, pos] (float32); the table is
    checked against ``kernel``'s rows a tile."""
    check_tiles(tiles, token_slot, token_pos, tile_rows(kernel, q.shape[1] // k_cache.shape[1], q.shape[2]))
    out = np.empty_like(q, dtype=np.float32)
    for first, rows, slot in np.asarray(tiles):
        if rows:
            rows_at = slice(first, first + rows)
            out[rows_at] = attention_ref(q[rows_at], k_cache, v_cache, np.full(rows, slot, np.int32),
                                         np.asarray(token_pos)[rows_at], scale)
    return out


@functools.cache
def tile_kernel(storage: str, head_dim: int, group: int):
    """(kernel, threads per block) for a cache of ``storage`` ('bf16' | 'fp32'); hd a multiple of WARP."""
    if head_dim % WARP:
        raise ValueError(f"head_dim {head_dim}: the tile kernel spreads a row over {WARP} lanes")
    pairs = rows_per_tile(group, head_dim) * group
    if not pairs:
        raise ValueError(f"attention tiles of {group} heads of {head_dim} need more shared memory")
    load_quad = QUAD[storage]
    per_lane = head_dim // WARP  # output elements of a pair per lane
    quads = head_dim // 4
    stride = head_dim + 1  # of a key's row in shared memory
    pairs_per_warp = -(-pairs // WARPS)
    num_threads = WARPS * WARP
    q_size, kv_size, p_size = pairs * head_dim, WARP * stride, pairs * WARP
    acc_size = pairs_per_warp * per_lane

    @kernel
    def attention_tile_split(q, k_words, v_words, num_kv_heads, context, tiles, token_pos, scale, partial):
        tile, kv_head, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        first_row, rows, slot = tiles[tile, 0], tiles[tile, 1], tiles[tile, 2]
        if rows < 2:
            return  # an unused tile, or a decode row (the decode kernel's): the whole block
        first, end, num_splits = split_range(0, token_pos[first_row + rows - 1], split)
        if split >= num_splits:
            return
        q_tile = cuda.shared.array(q_size, float32)  # pair p = (row p // group, head p % group)
        kv_tile = cuda.shared.array(kv_size, float32)  # WARP keys, then their values
        probs = cuda.shared.array(p_size, float32)  # (pair, key of the tile)
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP, tid % WARP
        for n in range(tid, q_size, num_threads):  # zeros past the tile's rows
            pair, d = n // head_dim, n % head_dim
            q_tile[n] = q[first_row + pair // group, kv_head * group + pair % group, d] * scale \
                if pair < rows * group else float32(0.0)
        scores = cuda.local.array(pairs_per_warp, float32)
        run_max = cuda.local.array(pairs_per_warp, float32)
        run_sum = cuda.local.array(pairs_per_warp, float32)
        row_pos = cuda.local.array(pairs_per_warp, np.int32)
        acc = cuda.local.array(acc_size, float32)
        for i in range(pairs_per_warp):  # the warp's pairs: warp + WARPS i
            r = (warp + WARPS * i) // group
            row_pos[i] = token_pos[first_row + r] if r < rows else -1  # -1: not a pair of this tile
            run_max[i] = NEG_INF
            run_sum[i] = float32(0.0)
            for e in range(per_lane):
                acc[i * per_lane + e] = float32(0.0)
        base = (slot * num_kv_heads + kv_head) * context
        for start in range(first, end, WARP):
            cuda.syncthreads()  # the previous values are used up (and the queries are in)
            for n in range(tid, WARP * quads, num_threads):
                load_quad(k_words, base + min(start + n // quads, end - 1), n % quads, kv_tile,
                          (n // quads) * stride + 4 * (n % quads))
            cuda.syncthreads()
            key = start + lane  # this lane's key
            for i in range(pairs_per_warp):
                scores[i] = float32(0.0)
            for d in range(head_dim):
                k = kv_tile[lane * stride + d]
                for i in range(pairs_per_warp):
                    scores[i] += q_tile[min(warp + WARPS * i, pairs - 1) * head_dim + d] * k
            for i in range(pairs_per_warp):
                if row_pos[i] >= 0:  # the same in every lane (shuffles)
                    score = scores[i] if key < end and key <= row_pos[i] else NEG_INF
                    peak = max(run_max[i], warp_max(score))
                    p = float32(0.0)
                    if peak > NEG_INF:  # else no key of this tile is visible to the row yet
                        alpha = math.exp(run_max[i] - peak)
                        p = math.exp(score - peak)
                        run_sum[i] = run_sum[i] * alpha + warp_sum(p)
                        for e in range(per_lane):
                            acc[i * per_lane + e] *= alpha
                        run_max[i] = peak
                    probs[(warp + WARPS * i) * WARP + lane] = p
            cuda.syncthreads()  # the keys are used up
            for n in range(tid, WARP * quads, num_threads):
                load_quad(v_words, base + min(start + n // quads, end - 1), n % quads, kv_tile,
                          (n // quads) * stride + 4 * (n % quads))
            cuda.syncthreads()
            for kk in range(min(WARP, end - start)):
                for i in range(pairs_per_warp):
                    if row_pos[i] >= 0:
                        p = probs[(warp + WARPS * i) * WARP + kk]
                        for e in range(per_lane):
                            acc[i * per_lane + e] += p * kv_tile[kk * stride + lane + WARP * e]
        for i in range(pairs_per_warp):
            if row_pos[i] >= 0:  # a row that saw no key of this split leaves (0, -inf, 0): weight 0 in the merge
                pair = warp + WARPS * i
                t, head = first_row + pair // group, kv_head * group + pair % group
                for e in range(per_lane):
                    partial[t, head, split, lane + WARP * e] = acc[i * per_lane + e]
                if lane == 0:
                    partial[t, head, split, head_dim] = run_max[i]
                    partial[t, head, split, head_dim + 1] = run_sum[i]

    return attention_tile_split, num_threads


@kernel
def merge_tile_splits(tiles, max_rows, token_pos, split_positions, partial, out):
    # one thread per output (tile, row, h, d): the tile's splits combined in order (deterministic);
    # a tile of 2+ rows has splits of at least split_positions keys (its kernel's), a decode row the
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
    # kernel's work for a chunk row is a block per kv head over key 0, overwritten by the tile kernel)
    for n in range(cuda.grid(1), tiles.shape[0] * max_rows, cuda.gridsize(1)):
        first_row, rows = tiles[n // max_rows, 0], tiles[n // max_rows, 1]
        if n % max_rows < rows:
            out[first_row + n % max_rows] = token_pos[first_row] if rows == 1 else 0


def attention_tiles_cuda(q, k_cache, v_cache, tiles, token_slot, token_pos, scale: float, out, scratch=None,
                         decode_pos=None, stream=0, kernel: str = "numba"):
    """out (T, H, hd) = attention_tiles_ref(...) on device arrays (the table is not checked here: the
    stage builds it, chunk_tiles, with tile_rows(kernel, ...) rows a tile). Tiles of one row (decode
    rows) run on the decode kernel, as in a step without a chunk (same splits, same bits); the
    others on the tile kernel, ``kernel`` "numba" (this file's) or "tc" (attention_chunk_tc.py:
    tensor cores, bf16 caches); one merge. Every row's own position must already be in the cache.
    ``scratch``: float32 of attention.attention_scratch_shape, ``decode_pos``: (T,) int32 (each
    allocated here when None). hd: a multiple of 32 (numba)."""
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
    if kernel not in KERNELS:
        raise ValueError(f"chunk attention kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if kernel == "tc" and storage != "bf16":
        raise ValueError(f"the tensor-core chunk attention reads bf16 caches, not {storage}")
    if kernel == "numba":
        attend, tile_threads = tile_kernel(storage, head_dim, group)  # (refuses a head_dim before any launch)
    context = k_cache.shape[2]
    scratch_shape = attention_scratch_shape(num_tokens, num_heads, head_dim, context)
    if scratch is None:
        scratch = cuda.device_array(scratch_shape, np.float32, stream=stream)
    require("scratch", scratch, np.float32, shape=scratch_shape)
    if decode_pos is None:
        decode_pos = cuda.device_array(num_tokens, np.int32, stream=stream)
    require("decode_pos", decode_pos, np.int32, shape=(num_tokens,))
    max_rows = tile_rows(kernel, group, head_dim)
    grid = blocks(ceil_div(tiles.shape[0] * max_rows, THREADS))
    decode_positions[grid, threads(THREADS), stream](tiles, max_rows, token_pos, decode_pos)
    k_words, v_words, scale = words(k_cache), words(v_cache), np.float32(scale)
    decode, num_threads = decode_kernel(storage, head_dim, group)
    decode[(num_tokens, num_kv_heads, scratch_shape[2]), num_threads, stream](
        q, k_words, v_words, num_kv_heads, context, token_slot, decode_pos, scale, 0, scratch)
    if kernel == "tc":
        from moebus.cuda.kernels import attention_chunk_tc

        split_keys = attention_chunk_tc.SPLIT_KEYS
        attention_chunk_tc.launch(q, k_cache, v_cache, tiles, token_pos, scale, scratch, stream, split_keys)
    else:
        split_keys = SPLIT_POSITIONS
        attend[(tiles.shape[0], num_kv_heads, scratch_shape[2]), tile_threads, stream](
            q, k_words, v_words, num_kv_heads, context, tiles, token_pos, scale, scratch)
    merge_tile_splits[blocks(ceil_div(tiles.shape[0] * max_rows * num_heads * head_dim, THREADS)), threads(THREADS),
                      stream](tiles, max_rows, token_pos, split_keys, scratch, out)
    return out
