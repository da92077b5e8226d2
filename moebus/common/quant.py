"""Quantized weight formats, in numpy: FP8 e4m3 with 128 x 128 block scales (the format Qwen and
DeepSeek publish) and 4-bit with a scale and a minimum per group of 128 along the input dimension.

FP8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7F / 0xFF are NaN, the
largest finite value is 448. Our own encoder (round to nearest even, saturating) and a 256-entry
decode table; no extra dependency, checked against torch's float8_e4m3fn in the tests.

A block-scaled matrix W (R x C) is stored as codes q (R x C) and ``scale_inv`` (ceil(R/128) x
ceil(C/128)), W[r, c] = e4m3(q[r, c]) * scale_inv[r // 128, c // 128]; edge blocks are partial.

4-bit: codes 0..15, two to a byte (low nibble = even column), and per (row, group of 128 columns)
a scale s and minimum m: W[r, c] = q[r, c] * s + m (asymmetric, round to nearest). Chosen over the
symmetric form (q - 8) * s by measured error (``int4_relative_error``; docs/expert-cache.md)."""
from __future__ import annotations

import numpy as np

BLOCK = 128  # FP8 block side and 4-bit group length
E4M3_MAX = 448.0
INT4_LEVELS = 15


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, mant = (codes >> 3) & 0xF, codes & 7
    values = np.where(exp == 0, mant * 2.0**-9, (1.0 + mant / 8.0) * 2.0 ** (exp - 7.0)) * sign
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def e4m3_encode(values: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn codes (uint8): round to nearest even, magnitudes above 448 saturate."""
    x = np.asarray(values, dtype=np.float32)
    mag = np.minimum(np.abs(x), np.float32(E4M3_MAX))
    # normals: round the float32 mantissa from 23 to 3 bits (to even), then rebias 127 -> 7; the
    # uint32 sums cannot overflow for magnitudes <= 448
    u = mag.view(np.uint32)
    rounded = (u >> 20) & 1
    rounded += 0x7FFFF
    rounded += u
    rounded >>= 20
    rounded -= (127 - 7) << 3  # wraps for subnormals, which take the other branch
    # below 2^-6 (subnormal in e4m3): multiples of 2^-9; rint rounds half to even; 8 -> 2^-6 (code 8)
    small = mag < np.float32(2.0**-6)
    rounded[small] = np.rint(mag[small] * np.float32(2.0**9)).astype(np.uint32)
    code = np.minimum(rounded, 0x7E).astype(np.uint8)
    code |= (np.signbit(x).astype(np.uint8) << 7).astype(np.uint8)
    return code


def block_grid(rows: int, cols: int) -> tuple[int, int]:
    """The scale grid of a block-scaled matrix: partial edge blocks count."""
    return -(-rows // BLOCK), -(-cols // BLOCK)


def _expand_blocks(grid: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return np.repeat(np.repeat(grid, BLOCK, axis=0), BLOCK, axis=1)[:rows, :cols]


def _blocked(w: np.ndarray) -> np.ndarray:
    """(ceil R/128, 128, ceil C/128, 128) zero-padded copy of w."""
    rows, cols = w.shape
    br, bc = block_grid(rows, cols)
    if (rows, cols) == (br * BLOCK, bc * BLOCK):
        return np.array(w, dtype=np.float32).reshape(br, BLOCK, bc, BLOCK)
    padded = np.zeros((br * BLOCK, bc * BLOCK), np.float32)
    padded[:rows, :cols] = w
    return padded.reshape(br, BLOCK, bc, BLOCK)


def fp8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes (R, C) uint8, scale_inv (ceil R/128, ceil C/128) float32): each block's largest
    magnitude maps to 448 (an all-zero block gets scale 1)."""
    rows, cols = w.shape
    blocks = _blocked(np.asarray(w, dtype=np.float32))
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    blocks /= scale[:, None, :, None]
    codes = e4m3_encode(blocks).reshape(blocks.shape[0] * BLOCK, -1)
    return np.ascontiguousarray(codes[:rows, :cols]), scale


def fp8_dequantize(codes: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """float32 (R, C) from codes and their block scales (float32 or bf16-valued float32)."""
    rows, cols = codes.shape
    if tuple(scale_inv.shape) != block_grid(rows, cols):
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not fit a {rows} x {cols} matrix "
                         f"in {BLOCK} x {BLOCK} blocks (expected {block_grid(rows, cols)})")
    return e4m3_decode(codes) * _expand_blocks(np.asarray(scale_inv, np.float32), rows, cols)


def int4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed (R, ceil(C/2)) uint8, params (R, ceil(C/128), 2) float32 = (scale, minimum))."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    groups = -(-cols // BLOCK)
    params = np.zeros((rows, groups, 2), np.float32)
    codes = np.zeros((rows, groups * BLOCK), np.uint8)
    for g in range(groups):
        part = w[:, g * BLOCK : (g + 1) * BLOCK]
        lo, hi = part.min(axis=1), part.max(axis=1)
        scale = np.where(hi > lo, (hi - lo) / np.float32(INT4_LEVELS), np.float32(1.0)).astype(np.float32)
        q = np.clip(np.rint((part - lo[:, None]) / scale[:, None]), 0, INT4_LEVELS)
        codes[:, g * BLOCK : g * BLOCK + part.shape[1]] = q.astype(np.uint8)
        params[:, g, 0], params[:, g, 1] = scale, lo
    codes = codes[:, : cols + cols % 2]
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), params


def int4_codes(packed: np.ndarray, cols: int) -> np.ndarray:
    codes = np.empty((packed.shape[0], 2 * packed.shape[1]), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4
    return codes[:, :cols]


def int4_dequantize(packed: np.ndarray, params: np.ndarray, cols: int) -> np.ndarray:
    scale = np.repeat(params[:, :, 0], BLOCK, axis=1)[:, :cols]
    minimum = np.repeat(params[:, :, 1], BLOCK, axis=1)[:, :cols]
    return int4_codes(packed, cols).astype(np.float32) * scale + minimum


def int4_symmetric_roundtrip(w: np.ndarray) -> np.ndarray:
    """The alternative measured against: q in -8..7, W = q * s with s = max|W| / 7 per group."""
    w = np.asarray(w, dtype=np.float32)
    out = np.empty_like(w)
    for g in range(0, w.shape[1], BLOCK):
        part = w[:, g : g + BLOCK]
        scale = np.abs(part).max(axis=1, keepdims=True) / np.float32(7.0)
        scale[scale == 0] = 1.0
        out[:, g : g + BLOCK] = np.clip(np.rint(part / scale), -8, 7) * scale
    return out


def int4_relative_error(w: np.ndarray) -> dict[str, float]:
    """Mean squared error over mean square of W, for the asymmetric (kept) and symmetric forms."""
    w = np.asarray(w, dtype=np.float32)
    power = float(np.mean(w.astype(np.float64) ** 2))
    asym = int4_dequantize(*int4_quantize(w), w.shape[1])
    return {"asymmetric": float(np.mean((asym - w) ** 2.0)) / power,
            "symmetric": float(np.mean((int4_symmetric_roundtrip(w) - w) ** 2.0)) / power}
