"""flash_attention.cu's arithmetic in numpy, tile by tile: the same query tiles (BLOCK_QUERIES) and key
tiles (``tile_keys``), the same first and last key of a block (causal, sliding window), the online
softmax in base 2 with the same guard for a row that has seen no key yet, and the products on split
bf16 parts summed in fp32. It checks the kernel's index math on CPU (tests/cuda/test_flash_attention)
against attention_ref / vision_attention_ref; on a GPU the kernel is compared with those too.
(numpy sums the products in its own order, so kernel and reference agree to rounding, not bits.)"""
from __future__ import annotations

import numpy as np

from moebus.cuda.dtypes import bf16_to_f32
from moebus.cuda.kernels.flash_attention import BLOCK_QUERIES, PRECISIONS, plane_shapes
from moebus.cuda.kernels.gemm import split_bf16_ref

SMEM_BYTES = 48 * 1024  # the .cu's static shared memory per block


def tile_keys(head_dim: int, f32_kv: bool, precision: str = "split", stages_wanted: int = 2) -> int:
    """BN of the .cu (its default, no TILE_KEYS): 64 keys, unless float32 keys and values then fit one
    stage of 48 KiB only: two stages of 32, else what one stage holds."""
    if not f32_kv:
        return 64
    k_parts, v_parts = (1 + split for split in PRECISIONS[precision])
    padded = -(-head_dim // 16) * 16

    def tile_bytes(keys: int) -> int:
        return 2 * (k_parts * keys * (padded + 8) + v_parts * head_dim * (keys + 8))

    for keys, stages in ((64, 2), (32, 2), (64, 1)):
        if stages <= stages_wanted and stages * tile_bytes(keys) <= SMEM_BYTES:
            return keys
    return 32


def key_range(first_query: int, last_query: int, num_keys: int, first_pos: int, window: int, causal: bool,
              keys_per_tile: int) -> tuple[int, int]:
    """[begin, end) of the keys a block of queries [first_query, last_query] reads: begin on a tile's
    start, end the last key any of its queries sees, plus one."""
    end = min(num_keys, first_pos + last_query + 1) if causal else num_keys
    begin = max(0, first_pos + first_query - window + 1) if causal and window > 0 else 0
    return begin - begin % keys_per_tile, end


def _parts(x: np.ndarray, exact: bool) -> list[np.ndarray]:
    """[hi, lo] as float32 values (exact bf16 input: [x])."""
    return [x] if exact else [bf16_to_f32(p) for p in split_bf16_ref(x)]


def _product(a: np.ndarray, b: np.ndarray, b_exact: bool, split: bool = True) -> np.ndarray:
    """a @ b as the kernel's mma's: a split in two parts, b split unless exact; lo.lo dropped. Not
    ``split`` (float32 b): one plain bf16 product, hi(a) @ hi(b)."""
    a_hi, a_lo = _parts(a, False)
    if not split and not b_exact:
        return a_hi @ _parts(b, False)[0]
    if b_exact:
        return a_lo @ b + a_hi @ b
    b_hi, b_lo = _parts(b, False)
    return a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi


def _tile_of(rows: np.ndarray, key_ids: np.ndarray, end: int) -> np.ndarray:
    """Rows key_ids of ``rows``, zeros at or past ``end`` (the kernel never reads them)."""
    real = key_ids < end
    return np.where(real[:, None], rows[np.minimum(key_ids, rows.shape[0] - 1)], 0).astype(np.float32)


def _seen(key_ids: np.ndarray, positions: np.ndarray, num_keys: int, window: int, causal: bool) -> np.ndarray:
    """(queries, keys) mask: causal with an optional sliding window, or every real key."""
    keys, pos = key_ids[None, :], positions[:, None]
    if not causal:
        return np.broadcast_to(keys < num_keys, (len(positions), len(key_ids)))
    return (keys <= pos) & ((keys > pos - window) if window > 0 else True)


def _query_tile(q, keys, values, q0: int, first_pos: int, window: int, causal: bool, scale_log2, kv_exact: bool,
                precision: str = "split"):
    """One block: BLOCK_QUERIES rows from q0 (rows past the end computed as zeros, not stored);
    ``precision`` of float32 keys and values (flash_attention.PRECISIONS)."""
    num_queries, head_dim = q.shape
    splits, per_tile = PRECISIONS[precision], tile_keys(head_dim, not kv_exact, precision)
    q_tile = np.zeros((BLOCK_QUERIES, head_dim), np.float32)
    q_tile[: min(BLOCK_QUERIES, num_queries - q0)] = q[q0:q0 + BLOCK_QUERIES]
    positions = first_pos + np.arange(q0, q0 + BLOCK_QUERIES)
    begin, end = key_range(q0, min(q0 + BLOCK_QUERIES, num_queries) - 1, keys.shape[0], first_pos, window, causal,
                           per_tile)
    row_max = np.full(BLOCK_QUERIES, -np.inf, np.float32)
    row_sum = np.zeros(BLOCK_QUERIES, np.float32)
    acc = np.zeros((BLOCK_QUERIES, head_dim), np.float32)
    for key0 in range(begin, end, per_tile):
        key_ids = np.arange(key0, key0 + per_tile)
        k_tile, v_tile = _tile_of(keys, key_ids, end), _tile_of(values, key_ids, end)
        s = _product(q_tile, k_tile.T, kv_exact, splits[0]).astype(np.float32)
        s = np.where(_seen(key_ids, positions, keys.shape[0], window, causal), s * scale_log2, -np.inf)
        new_max = np.maximum(row_max, s.max(axis=1)).astype(np.float32)
        base = np.where(new_max == -np.inf, np.float32(0), new_max)  # a row that has seen nothing stays at 0
        shrink = np.exp2(row_max - base)
        row_max = new_max
        p = np.exp2(s - base[:, None]).astype(np.float32)
        row_sum = row_sum * shrink + p.sum(axis=1)
        acc = acc * shrink[:, None] + _product(p, v_tile, kv_exact, splits[1]).astype(np.float32)
    inverse = np.where(row_sum > 0, 1 / np.where(row_sum > 0, row_sum, 1), 0).astype(np.float32)
    return acc * inverse[:, None]


def flash_block_ref(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first_pos: int, window: int, causal: bool,
                    scale: float, kv_exact: bool, precision: str = "split") -> np.ndarray:
    """One (sequence or image, head): q (n, hd) float32, keys and values (L, hd) float32 (bf16 values
    when kv_exact) -> (n, hd) float32, tiled as the kernel tiles it; ``precision`` of float32 keys
    and values as flash_attention.PRECISIONS."""
    scale_log2 = np.float32(scale * np.log2(np.e))
    out = np.zeros_like(q, dtype=np.float32)
    for q0 in range(0, q.shape[0], BLOCK_QUERIES):
        stored = min(BLOCK_QUERIES, q.shape[0] - q0)
        out[q0:q0 + stored] = _query_tile(q, keys, values, q0, first_pos, window, causal, scale_log2, kv_exact,
                                          precision)[:stored]
    return out


def flash_prefill_ref(q, k_cache, v_cache, segments, scale: float, window: int) -> np.ndarray:
    """flash_prefill_cuda in numpy: q (T, H, hd) float32, caches (S, KVH, C, hd) of bf16 bits (uint16)
    or float32, segments (first row, slot, start, length)."""
    q = np.asarray(q, np.float32)
    exact = np.dtype(k_cache.dtype) == np.uint16
    k_cache, v_cache = ((bf16_to_f32(c) if exact else np.asarray(c, np.float32)) for c in (k_cache, v_cache))
    _, heads, _ = q.shape
    group = heads // k_cache.shape[1]
    out = np.zeros_like(q)
    for row0, slot, start, length in segments:
        for h in range(heads):
            keys, values = (c[slot, h // group, : start + length] for c in (k_cache, v_cache))
            out[row0:row0 + length, h] = flash_block_ref(q[row0:row0 + length, h], keys, values, start, window or 0,
                                                         True, scale, exact)
    return out


def flash_images_ref(q, k, v, num_images: int, scale: float, precision: str = "split") -> np.ndarray:
    """flash_images_cuda in numpy: rows (N P, H, hd) float32, per image, bidirectional, its products
    split or plain bf16 (``precision``, flash_attention.PRECISIONS)."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    rows, heads, _ = q.shape
    positions = rows // num_images
    out = np.zeros_like(q)
    for image in range(num_images):
        at = slice(image * positions, (image + 1) * positions)
        for h in range(heads):
            out[at, h] = flash_block_ref(q[at, h], k[at, h], v[at, h], 0, 0, False, scale, False, precision)
    return out


def split_planes_ref(k, v, num_images: int) -> tuple[np.ndarray, np.ndarray]:
    """split_planes_cuda in numpy: k, v (N P, H, hd) float32 -> bf16 bits (uint16) of the keys
    (N, H, 2, P', hd') [hi, lo], zero past P and hd, and of the values transposed (N, H, 2, hd, P')."""
    k, v = (np.asarray(a, np.float32) for a in (k, v))
    rows, heads, head_dim = k.shape
    positions = rows // num_images
    k_shape, v_shape = plane_shapes(num_images, positions, heads, head_dim)
    k_planes, v_planes = np.zeros(k_shape, np.uint16), np.zeros(v_shape, np.uint16)
    for image in range(num_images):
        at = slice(image * positions, (image + 1) * positions)
        keys = split_bf16_ref(k[at].reshape(-1, head_dim)).reshape(2, positions, heads, head_dim)
        values = split_bf16_ref(v[at].reshape(-1, head_dim)).reshape(2, positions, heads, head_dim)
        k_planes[image, :, :, :positions, :head_dim] = keys.transpose(2, 0, 1, 3)
        v_planes[image, :, :, :, :positions] = values.transpose(2, 0, 3, 1)
    return k_planes, v_planes


def rope_planes_ref(q, k, v, bias, rope_pos, axes, cos, sin, num_images: int) -> tuple:
    """rope_planes_cuda in numpy: (mrope_ref(q + q's bias), *split_planes_ref(mrope_ref(k + k's
    bias), v + v's bias)), bias (3 H hd,) stored (q's, k's, v's)."""
    from moebus.cuda.dtypes import to_f32
    from moebus.cuda.kernels.mrope import mrope_ref

    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    _, heads, head_dim = q.shape
    q_bias, k_bias, v_bias = np.asarray(bias).reshape(3, heads * head_dim)
    q_out = mrope_ref(q, rope_pos, axes, cos, sin, q_bias)
    keys = mrope_ref(k, rope_pos, axes, cos, sin, k_bias)
    values = (v + to_f32(v_bias).reshape(heads, head_dim)).astype(np.float32)
    return (q_out, *split_planes_ref(keys, values, num_images))
