"""The FP8 dense projections of a decode step at batch 1 (the attention's q|k|v and o with ``attention.dtype``
fp8) on tensor cores (nineteenth session, issue 16): moe_quant_mma.cu's GEMV compiled with DENSE (one x row, one
matrix, linear_quant.py's scales: a float32 per row and 128 inputs), taken by linear_quant.linear_fp8_cuda before
linear_quant_fp8.py's numba one-round kernel where ``takes`` says so: MOEBUS_QUANT_MMA names ``attn`` (``all``, the
default, does), one token, rows of whole 16-byte words, 16-byte aligned codes, a GPU with cvt.rn.f16x2.e4m3x2
(sm_89+), a stream object, the kernel built; else the numba kernel, as before.

Why: the numba kernel's true durations in the 48 x 32 A3B step (seventeenth session, PDL off) are q|k|v 5.5 us
(10.5 MB: 1.9 TB/s) and o 4.8 (8.4 MB: 1.75 TB/s), bound by ~7 instructions a code as the experts' were; the
experts on tensor cores (mma18) save ~3.1 us a layer, issue 16's 1.5x needs ~3.8.

Precision (moe_quant_mma's): e4m3 -> f16 exact, x rounded to f16 after a power of two a 64-input chunk (exact, undone
in f32), products exact, sums in f32: |got - exact| <= 1.5 * 2^-11 * sum_k |w_k x_k| (tests/cuda/
test_linear_quant_mma.py); moe_quant_mma_ref.gemv_ref(..., row_scales=True) is its arithmetic in numpy. Not the
numba kernel's bits.

PDL: the weights' codes and scales are loaded before griddepcontrol.wait (LOAD_BEFORE_WAIT, on: a weight never
changes within a step, so its bytes come from HBM while the kernel before it ends), x after it; launch_dependents after
the wait where MOEBUS_PDL_TRIGGER; registered as waiting. H200, 48 x 32 b1 decode (nineteenth session, call B): fp8
experts and projections on tensor cores 477.8 / 476.1 tok/s with the early weights, 450.3 without (call A); the numba
kernel gains nothing from them (linear_quant_fp8.LOAD_BEFORE_WAIT stays off).

Shapes (TILES, KSPLIT, WORDS, MIN_BLOCKS) by the row's length (COLS), sm_90 ptxas registers, no spills: A3B q|k|v
(2,048 -> 5,120, 320 tiles of 16 rows) (1, 8, 4, 4) 64 registers (one pass: 8 warps x 4 steps of 64 cover a row;
4 blocks of 256 an SM: 528 places, one wave), (1, 8, 4, 3) 80, (1, 16, 2, 2) 59 (264 places: 1.2 waves),
(1, 4, 8, 4) 128; o (4,096 -> 2,048, 128 tiles) (1, 16, 4, 1) 98 (one pass, a block an SM), (1, 32, 2, 1) 59,
(1, 8, 8, 1) 129, (1, 16, 4, 2) 64. Other lengths: KSPLIT warps of 4 steps over the row (at most 16), one block.

ROUTE (twentieth session, issue 16; on): the o projection of a routed decode step (one token, an MoE
layer) takes norm_route's start as its end (moe_quant_mma.cu's ROUTE entry, ``launch_route``): the residual add
(total = x + o, norm_route's bits given the same o), and per 16-row tile the partial sums of the router's logits
(sum of router[e][i] * norm_weight[i] * total[i] over the tile's rows, bf16 router and norm weight) and of total^2;
norm_route.route_tail_cuda, one block, sums the tiles in a fixed order, scales the logits by the norm's 1 / rms
(logit = rms^-1 sum router * weight * total: the same sum as router . h in another order, within f32 rounding)
and writes h, the top-k and the pairs. Why: norm_route's true duration is 8.1 us a layer at 48 x 32 b1 (twentieth
session, call A) for a 128 KB router: its blocks each redo the norm, then a counter hands the logits to the last
block; here the router's 32 bytes a tile and expert ride with the o projection's loads. H200, 48 x 32 b1, all
resident (call C): int4 experts + FP8 attention 502.3 / 503.8 -> 541.9 / 540.9 tok/s, fp8 + fp8 495.0 -> 521.9,
the same greedy ids; true durations o 4.7 -> 5.1 us, norm_route 8.1 -> route_tail 5.7. Only the FP8 projections on
tensor cores take it (bf16 attention keeps linear + norm_route)."""
from __future__ import annotations

import numpy as np

from moebus.cuda.kernels import flash_attention, moe_quant_mma
from moebus.cuda.kernels.launch import ceil_div

VALUES = 16  # codes a 16-byte word
# by COLS: A3B's q|k|v and o. mma19_bench.py (H200, nineteenth session, call A; a launch alone, no PDL, weights after
# the wait): q|k|v (1, 8, 4, 4) 8.51 us, (1, 8, 4, 3) and (1, 4, 8, 4) 8.35 (numba 8.26); o (1, 16, 4, 1) 8.16,
# (1, 8, 8, 1) 7.68 (numba 7.87). In the 48 x 32 b1 decode (twentieth session, call A) o at (1, 8, 8, 1) was slower:
# int4 experts 495.9 tok/s against the default's 502.9 / 499.5, fp8 488.5 against 493.6: the defaults stay.
SHAPES = {2048: (1, 8, 4, 4), 4096: (1, 16, 4, 1)}
SWEEP = {2048: ((1, 8, 4, 4), (1, 8, 4, 3), (1, 16, 2, 2), (1, 4, 8, 4)),
         4096: ((1, 16, 4, 1), (1, 32, 2, 1), (1, 8, 8, 1), (1, 16, 4, 2))}  # the bench's, the defaults first
WORDS, MAX_KSPLIT = 4, 16
LOAD_BEFORE_WAIT = True  # the module's docstring (PDL)
ROUTE = True  # the module's docstring (ROUTE): launch_route where takes_route


def shape_for(cols: int) -> tuple:
    """SHAPES' entry (its keys ints, or strings: a sweep plan's JSON), else KSPLIT warps of WORDS steps (64 inputs)
    covering the row, at most MAX_KSPLIT."""
    found = SHAPES.get(cols) or SHAPES.get(str(cols))
    return tuple(found or (1, min(MAX_KSPLIT, ceil_div(ceil_div(cols, 64), WORDS)), WORDS, 1))


def fits(x, codes, scales) -> bool:
    """One token, rows of whole 16-byte words, C-ordered codes (16-byte aligned) and scales (x: linear_fp8_cuda
    checks it)."""
    from moebus.cuda.kernels.compat import is_contiguous
    from moebus.cuda.kernels.moe_quant_round import aligned

    return (x.shape[0] == 1 and codes.shape[1] % VALUES == 0 and codes.shape[0] > 0 and aligned(codes)
            and is_contiguous(codes) and is_contiguous(scales))


def takes(x, codes, scales, stream) -> bool:
    """Whether linear_fp8_cuda runs this kernel (MOEBUS_QUANT_MMA's ``attn``, read at each call)."""
    num_rows, cols = codes.shape
    return ("attn" in moe_quant_mma.FORMATS and fits(x, codes, scales) and moe_quant_mma._stream_object(stream)
            and moe_quant_mma._gpu_ok()
            and moe_quant_mma._builds(cols, num_rows, 1, shape_for(cols), _early(), "fp8", True))


def _early() -> bool:
    return bool(LOAD_BEFORE_WAIT)


def launch(x, codes, scales, out, stream, shape=None, early=None):
    """out (1, R) float32 = x (1, C) float32 @ the FP8 weight (codes (R, C) e4m3, scales (R, ceil(C / 128))) ^T;
    ``stream``: a numba stream or a GraphBuilder; ``shape`` and ``early``: the module's (the bench sweeps them)."""
    num_rows, cols = codes.shape
    shape = tuple(shape or shape_for(cols))
    early = _early() if early is None else early
    kernel = moe_quant_mma._kernel(cols, num_rows, 1, shape, early, "fp8", True)
    ptr = moe_quant_mma._pointer
    flash_attention._core_launch(stream, (moe_quant_mma.grid_x(num_rows, shape), 1), 32 * shape[0] * shape[1],
                                 kernel, ptr(x), ptr(codes), ptr(scales), ptr(out))
    return out



def takes_route(a, codes, scales, residual, norm_weight, router, stream) -> bool:
    """Whether the routed decode's o projection runs ``launch_route`` (ROUTE, read at each call): ``takes`` and a
    one-tile shape for the row, whole tiles of rows, bf16 router (E, R) and norm weight (R,), 16-byte aligned and
    C-ordered, fewer experts than the block's threads and at most routing.MAX_EXPERTS, f32 residual (1, R)."""
    from moebus.cuda.kernels.compat import is_contiguous
    from moebus.cuda.kernels.moe_quant_round import aligned
    from moebus.cuda.kernels.routing import MAX_EXPERTS

    num_rows, cols = codes.shape
    shape = shape_for(cols)
    num_experts = router.shape[0]
    return (ROUTE and shape[0] == 1 and num_rows % 16 == 0 and 0 < num_experts < 32 * shape[1]
            and num_experts <= MAX_EXPERTS
            and router.dtype == np.uint16 and norm_weight.dtype == np.uint16 and router.shape == (num_experts, num_rows)
            and norm_weight.shape == (num_rows,) and residual.shape == (1, num_rows) and residual.dtype == np.float32
            and aligned(router, norm_weight) and is_contiguous(router) and is_contiguous(norm_weight)
            and takes(a, codes, scales, stream)
            and moe_quant_mma._builds(cols, num_rows, 1, shape, _early(), "fp8", True, num_experts))


def launch_route(a, codes, scales, residual, norm_weight, router, total, partial, stream):
    """total (1, R) = residual + a @ W^T (the FP8 weight (codes, scales)); partial (R / 16, E + 1) float32: a 16-row
    tile's sums of router[e][i] * norm_weight[i] * total[i] (e < E) and of total[i]^2 (the module's ROUTE)."""
    num_rows, cols = codes.shape
    shape = shape_for(cols)
    kernel = moe_quant_mma._kernel(cols, num_rows, 1, shape, _early(), "fp8", True, router.shape[0])
    ptr = moe_quant_mma._pointer
    flash_attention._core_launch(stream, (num_rows // 16, 1), 32 * shape[0] * shape[1], kernel, ptr(a), ptr(codes),
                                 ptr(scales), ptr(residual), ptr(norm_weight), ptr(router), ptr(total), ptr(partial))
    return total, partial


def takes_normed(x, codes, scales, square, norm_weight, stream) -> bool:
    """Whether ``launch_normed`` runs: ``takes`` (one token), the row's length a multiple of 64 (whole float4 of its
    16-row tiles' squares), bf16 norm weight (C,) 16-byte aligned, float32 squares (C / 16,) 16-byte aligned, the
    kernel built."""
    from moebus.cuda.kernels.compat import data_ptr, is_contiguous
    from moebus.cuda.kernels.moe_quant_round import aligned

    num_rows, cols = codes.shape
    return (cols % 64 == 0 and norm_weight.dtype == np.uint16 and norm_weight.shape == (cols,)
            and square.dtype == np.float32 and square.shape == (cols // 16,) and data_ptr(square) % 16 == 0
            and aligned(norm_weight) and is_contiguous(norm_weight) and takes(x, codes, scales, stream)
            and moe_quant_mma._builds(cols, num_rows, 1, shape_for(cols), _early(), "fp8", True, normed=True))


def launch_normed(x, codes, scales, square, norm_weight, eps: float, out, stream):
    """out (1, R) = rmsnorm(x) @ W^T: x (1, C) float32, ``square`` (C / 16,) its 16-row tiles' sums of x^2
    (moe_quant_mma.launch_down_combine's), the norm as fused.normed_store's, made while x is staged."""
    num_rows, cols = codes.shape
    shape = shape_for(cols)
    kernel = moe_quant_mma._kernel(cols, num_rows, 1, shape, _early(), "fp8", True, normed=True)
    ptr = moe_quant_mma._pointer
    flash_attention._core_launch(stream, (moe_quant_mma.grid_x(num_rows, shape), 1), 32 * shape[0] * shape[1],
                                 kernel, ptr(x), ptr(codes), ptr(scales), ptr(norm_weight), ptr(square),
                                 np.float32(eps), ptr(out))
    return out
