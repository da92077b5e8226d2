"""moe_quant_mma.py's kernels' arithmetic in numpy: x staged as f16 after a power of two a chunk, a step's products
summed exactly (f32 in the mma), scale x 2^-e times that added to the warp's f32 total in the warp's step order, the
KSPLIT warps' totals in order. Within f32 sums of the GPU's (the GPU tests' tight reference) and within the f16
bound of moe_quant.expert_ffn_quant_ref (tests/cuda/test_moe_quant_mma.py)."""
from __future__ import annotations

import numpy as np

from moebus.cuda.kernels import moe_quant_mma


def staged_ref(x, chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(x as the block stages it: f16 values times 2^e a ``chunk``-input chunk (fp8 64, int4 128), zero past its
    end, (steps, chunk) float64; 2^-e a chunk, float32): the .cu's stage_x."""
    x = np.asarray(x, np.float32)
    steps = -(-x.shape[0] // chunk)
    padded = np.zeros(steps * chunk, np.float32)
    padded[: x.shape[0]] = x
    chunks = padded.reshape(steps, chunk)
    top = np.abs(chunks).max(axis=1)
    exponent = np.zeros(steps, np.int64)
    live = top > 0
    exponent[live] = np.clip(14 - (np.frexp(top[live])[1] - 1), -100, 100)
    scaled = (chunks * np.ldexp(np.float32(1), exponent)[:, None].astype(np.float32)).astype(np.float16)
    return scaled.astype(np.float64), np.ldexp(np.float32(1), -exponent).astype(np.float32)


def gemv_ref(x, codes, scales, shape: tuple, row_scales: bool = False) -> np.ndarray:
    """One matrix's GEMV as the kernel computes it: codes (R, C) e4m3 (uint8), scales (ceil(R/128), ceil(C/128))
    float32 (``row_scales``: (R, ceil(C/128)), a dense projection's), x (C,) float32 -> (R,) float32. A step's 64
    products summed (exact here, f32 in the mma), scale x 2^-e times that added to the warp's f32 total in the warp's
    step order, the KSPLIT warps' totals in order."""
    from moebus.common.quant import e4m3_decode

    _, ksplit, words, _ = shape
    xs, inverse = staged_ref(x)
    rows, cols = codes.shape
    steps = xs.shape[0]
    values = np.zeros((rows, steps * 64), np.float64)
    values[:, :cols] = e4m3_decode(codes)
    sums = np.einsum("rsk,sk->rs", values.reshape(rows, steps, 64), xs).astype(np.float32)
    per_row = scales if row_scales else scales[np.arange(rows) // 128]
    factor = per_row[:, (64 * np.arange(steps)) // 128] * inverse  # (R, steps) float32
    return _warps_sum(ksplit, words, steps, rows, lambda s: (factor[:, s] * sums[:, s],))


def gemv_int4_ref(x, packed, params, shape: tuple) -> np.ndarray:
    """gemv_ref for int4: packed (R, C/2) codes (low nibble first), params (R, ceil(C/128), 2) (scale, minimum):
    a step (128 inputs, one group) adds s 2^-e sum q x16 + m sum x (sum x in float32, as the block's sums)."""
    from moebus.common.quant import int4_codes

    _, ksplit, words, _ = shape
    xs, inverse = staged_ref(x, 128)
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    steps = xs.shape[0]
    values = np.zeros((rows, steps * 128), np.float64)
    values[:, :cols] = int4_codes(packed, cols)
    sums = np.einsum("rsk,sk->rs", values.reshape(rows, steps, 128), xs).astype(np.float32)
    padded = np.zeros(steps * 128, np.float32)
    padded[:cols] = np.asarray(x, np.float32)
    sum_x = padded.reshape(steps, 128).sum(axis=1, dtype=np.float32)
    return _warps_sum(ksplit, words, steps, rows,
                      lambda s: (params[:, s, 1] * sum_x[s], (params[:, s, 0] * inverse[s]) * sums[:, s]))


def expert_ffn_mma_ref(x, pairs, arena, layout, store=None, gate_up_shape=None, down_shape=None):
    """(h (J, I), out rows (J, D)) of pairs [(token, slot, _)] as the kernels compute them (gemv_ref; silu(g) u in
    float32): within float32 sums of the GPU's, and within moe_quant_mma's f16 bound of expert_ffn_quant_ref."""
    gate_up_shape = tuple(gate_up_shape or moe_quant_mma.shapes(layout.dtype)[0])
    down_shape = tuple(down_shape or moe_quant_mma.shapes(layout.dtype)[1])
    gemv = gemv_ref if layout.dtype == "fp8" else gemv_int4_ref
    h, out = [], []
    for token, slot, _ in pairs:
        blob = np.asarray(arena[slot] if slot >= 0 else store[-1 - slot])
        (gate, gate_s), (up, up_s), (down, down_s) = layout.parts(blob)
        g = gemv(x[token], gate, gate_s, gate_up_shape)
        u = gemv(x[token], up, up_s, gate_up_shape)
        with np.errstate(over="ignore"):
            h.append((g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32))
        out.append(gemv(h[-1], down, down_s, down_shape))
    return np.array(h), np.array(out)


def dense_ref(x, codes, scales, shape=None) -> np.ndarray:
    """linear_quant_mma's kernel in numpy: (1, R) float32 = x (1, C) @ the FP8 weight (codes (R, C), scales (R,
    ceil(C/128))) ^T as gemv_ref with a scale per row; ``shape``: linear_quant_mma.shape_for's by default."""
    from moebus.cuda.kernels import linear_quant_mma

    shape = tuple(shape or linear_quant_mma.shape_for(codes.shape[1]))
    return gemv_ref(np.asarray(x, np.float32)[0], np.asarray(codes), np.asarray(scales, np.float32), shape,
                    row_scales=True)[None]


def _warps_sum(ksplit: int, words: int, steps: int, rows: int, terms) -> np.ndarray:
    """The kernels' order of the sums: warp w of a block adds steps first + w words + i (i < words) of each pass,
    each step's ``terms(s)`` in turn, in float32; then the warps' partials in warp order."""
    total = np.zeros((ksplit, rows), np.float32)
    for first in range(0, steps, ksplit * words):
        for warp in range(ksplit):
            for i in range(words):
                s = first + warp * words + i
                if s < steps:
                    for term in terms(s):
                        total[warp] += term
    out = np.zeros(rows, np.float32)
    for warp in range(ksplit):
        out += total[warp]
    return out


def route_partials_ref(total, norm_weight, router) -> np.ndarray:
    """The ROUTE entry's partials (R / 16, E + 1) float32 of total (R,) float32, norm_weight (R,) and router (E, R)
    as float32: a 16-row tile's sum over its rows of router[e][i] * (norm_weight[i] * total[i]) (in row order, f32)
    and of total[i]^2 (linear_quant_mma.launch_route)."""
    total = np.asarray(total, np.float32).reshape(-1, 16)
    scaled = np.asarray(norm_weight, np.float32).reshape(-1, 16) * total
    router = np.asarray(router, np.float32)
    tiles, experts = total.shape[0], router.shape[0]
    out = np.zeros((tiles, experts + 1), np.float32)
    for r in range(16):  # f32 sums in row order, as the kernel's fmaf chain (within an ulp: fma rounds once)
        out[:, :experts] += router[:, r::16].T * scaled[:, r : r + 1]
        out[:, experts] += total[:, r] * total[:, r]
    return out


def down_combine_ref(h, pairs, weights, residual, arena, layout, store=None, shape=None):
    """moe_quant_mma.launch_down_combine's arithmetic: pairs [(slot, rank)] of one token (pair j's x is h[j]), each
    pair's down GEMV as gemv_ref computes it (``shape``: the COMBINE shape), total = residual + the sum over ranks
    in order of weights[rank] * y (float32), square = the 16-row tiles' sums of total^2 (float32; the kernel's
    butterfly adds them in another order: within f32 rounding). Returns (total (1, D), square (D / 16,))."""
    shape = tuple(shape or moe_quant_mma.combine_shape(layout.dtype))
    gemv = gemv_ref if layout.dtype == "fp8" else gemv_int4_ref
    by_rank = {}
    for j, (slot, rank) in enumerate(pairs):
        blob = np.asarray(arena[slot] if slot >= 0 else store[-1 - slot])
        down, down_s = layout.parts(blob)[2]
        by_rank[rank] = gemv(np.asarray(h[j], np.float32), down, down_s, shape)
    weights = np.asarray(weights, np.float32).reshape(-1)
    mixed = np.zeros(layout.hidden, np.float32)
    for rank in range(len(pairs)):
        mixed = (mixed + weights[rank] * by_rank[rank]).astype(np.float32)
    total = (np.asarray(residual, np.float32).reshape(-1) + mixed).astype(np.float32)
    square = (total.reshape(-1, 16).astype(np.float64) ** 2).sum(axis=1).astype(np.float32)
    return total[None], square


def normed_ref(x, square, norm_weight, eps: float, codes, scales, shape=None) -> np.ndarray:
    """linear_quant_mma.launch_normed's arithmetic: 1 / rms from the tiles' squares (float32), x staged as
    norm_weight * (x * 1 / rms) (fused.normed_store's order), then dense_ref. (1, R) float32."""
    from moebus.cuda.kernels import linear_quant_mma

    x = np.asarray(x, np.float32).reshape(-1)
    total = np.float32(np.asarray(square, np.float64).sum())
    inv = np.float32(1) / np.sqrt(total / np.float32(x.shape[0]) + np.float32(eps), dtype=np.float32)
    h = (np.asarray(norm_weight, np.float32) * (x * inv)).astype(np.float32)
    shape = tuple(shape or linear_quant_mma.shape_for(codes.shape[1]))
    return dense_ref(h[None], codes, scales, shape)
