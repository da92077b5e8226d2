"""The quantized expert GEMVs of a decode step at batch 1 on tensor cores (moe_quant_mma.cu; eighteenth session,
issue 16): moe_quant.expert_ffn_quant_cuda takes them instead of moe_quant_round.py's numba kernels where ``takes``
says so (MOEBUS_QUANT_MMA names the formats: all by default, 0 for the numba kernels; ``attn``: the FP8 attention
projections on the same GEMV, linear_quant_mma.py; runs of one pair, a GPU with cvt.rn.f16x2.e4m3x2 (sm_89+), rows
of whole 16-byte words, a stream object, the kernels built). Why: the numba kernels issue ~7 instructions a code
(e4m3 -> f16 -> f32 conversions, x from shared memory, FFMA, addressing) and take ~2x what their bytes take at HBM rate
(seventeenth session: fp8 gate|up 9.6 us a layer, down 8.0, 48 x 32 A3B; int4 gate|up 11.3, bound by its
decoding); on mma.sync m16n8k16 an fp8 code costs half a conversion and 1/32 of an mma, an int4 code
about one instruction (sm_90 SASS: ~2.5 instructions a code a lane with the overheads).

Precision: e4m3 -> f16 and int4 q -> f16 are exact; x (gate|up: the layer's input; down: h) is rounded to f16
after a power of two a chunk (fp8 64 inputs, int4 128; exact, undone in f32): each x_k within 2^-11 relative (those
below 2^-28 of their chunk's largest: within 2^-39 of it), products exact, sums in f32. So |got - exact| <= 2^-11
sum_k |w_k x_k| (int4: |q_k s| for |w_k|, m sum x in f32) + f32 sums; down adds gate|up's error through h
(tests/cuda/test_moe_quant_mma.py's bound). moe_quant_mma_ref.py: the same arithmetic in numpy. Not the
numba kernels' bits.

Shapes are compiled in (COLS, ROWS; one cubin each, kept on disk as flash_attention's). A shape of a kernel:
(TILES, KSPLIT, WORDS, MIN_BLOCKS): 16-row tiles a block, warps a tile splitting K, steps (4 words of a row: fp8 64
inputs, int4 128) a warp and pass, blocks an SM for the register cap (launch bounds). At b1 (8 pairs) gate|up has
384 tiles (fp8: 64 KB of codes each: all in registers at once would take 190 KB an SM), down 1,024 (12 KB). sm_90
(ptxas, A3B): fp8 gate|up (1, 8, 4, 2) 126 registers (2 blocks of 256 threads an SM: 1.45 waves), (1, 16, 2, 2) 64
with 28 bytes of spills (2 of 512: 1.45 waves, half the words a warp), (1, 8, 2, 3) two passes, 80 with 12 bytes
of spills (3 an SM: one wave, the second pass's loads issued during the first's products); fp8 down (4, 2, 6, 3)
80 (256 blocks of 256, one wave), (2, 6, 2, 4) 40 (512 of 384, one wave), (1, 2, 6, 8) 103 (1,024 of 64); int4
below (INT4_*)."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np

from moebus.cuda.kernels import flash_attention, pdl
from moebus.cuda.kernels.compat import data_ptr
from moebus.cuda.kernels.launch import ceil_div

log = logging.getLogger("moebus.cuda")
SOURCE = Path(__file__).with_suffix(".cu")
ENV = "MOEBUS_QUANT_MMA"
NAMES = frozenset({"fp8", "int4", "attn"})  # the experts' formats, the FP8 attention projections


def _formats(value: str) -> frozenset:
    """MOEBUS_QUANT_MMA: 0 / unset (off), 1 or fp8, int4, attn (the FP8 attention projections, linear_quant_mma.py),
    a comma list of those, all (every one): what these kernels take."""
    value = value.strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return frozenset()
    if value in ("1", "on", "true", "yes"):
        return frozenset({"fp8"})
    found = frozenset(NAMES if value == "all" else (v.strip() for v in value.split(",")))
    if not found <= NAMES:
        raise ValueError(f"{ENV}={value!r}: expected 0, 1, fp8, int4, attn, a comma list of them or all")
    return found


FORMATS = _formats(os.environ.get(ENV, "all"))  # on: nineteenth session, call B (performance.md: 1.53x / 1.55x bf16)
GATE_UP_ENTRY, DOWN_ENTRY, DENSE_ENTRY = "moe_quant_mma_gate_up", "moe_quant_mma_down", "linear_quant_mma"
ROUTE_ENTRY = "linear_quant_mma_route"  # the o projection with norm_route's start (linear_quant_mma.launch_route)
ROUTED_ENTRY = "moe_quant_mma_gate_up_routed"  # gate|up ending the routing (launch_gate_up_routed)
COMBINE_ENTRY = "moe_quant_mma_down_combine"  # one token's down GEMVs ending in the combine (launch_down_combine)
NORMED_ENTRY = "linear_quant_mma_normed"  # the dense GEMV of rmsnorm(x) (linear_quant_mma.launch_normed)
# the routed decode's gate|up ends the routing the o projection's ROUTE entry began (launch_gate_up_routed), in place
# of norm_route.route_tail's kernel (read at each call: the backend's routes_experts). Off: H200, 48 x 32 A3B, b1
# (twenty-first session, performance.md): fp8 527.3 against 518.9 tok/s, int4 530.0 / 529.1 against 544.7 / 541.9
# (its down GEMV can no longer read the pair tables before its wait)
ROUTED = os.environ.get("MOEBUS_ROUTED_GATE_UP", "0") != "0"
# the routed decode's down GEMV ends in the MoE's combine and the residual add, with the tiles' sums of squares from
# which the next layer's FP8 q|k|v GEMV normalizes its x (launch_down_combine, linear_quant_mma.launch_normed): the
# combine_add_rmsnorm kernel leaves the chain (read at each call: the backend's combines_experts). On: H200, 48 x 32
# A3B, b1, all resident (twenty-second session, performance.md): int4 + FP8 attention 540.2 / 539.5 -> 580.4 / 581.5
# tok/s (1.80x bf16), fp8 + fp8 521.8 -> 556.3; true durations down 4.85 + combine 3.80 -> 5.40, q|k|v 5.54 -> 5.74
COMBINE = os.environ.get("MOEBUS_DOWN_COMBINE", "1") != "0"
# (TILES, KSPLIT, WORDS, MIN_BLOCKS) of the down GEMV with the combine: a block takes a 16-row tile of every pair
# (KSPLIT warps a pair, top_k pairs: 32 * KSPLIT * top_k <= 1,024 threads); A3B (768 inputs: int4 6 steps of 128,
# fp8 12 of 64), one pass, a warp a pair. H200 b1 decode (as above; sm_90 registers): int4 (1, 1, 6, 1) 138
# registers 580.4 / 581.5 / 587.5 tok/s, (1, 2, 3, 1) 96: 578.9 / 579.1, (1, 3, 2, 1) 74: 567.4 / 568.3,
# (1, 1, 3, 1) 128 (two passes): 572.4; fp8 (1, 1, 12, 1) 167: 556.3, (1, 1, 6, 1) 164: 554.7, (1, 2, 6, 1) 116:
# 554.3 / 549.7, (1, 2, 3, 1) 128: 551.4
COMBINE_SHAPES = {"int4": (1, 1, 6, 1), "fp8": (1, 1, 12, 1)}
# fp8: (TILES, KSPLIT, WORDS, MIN_BLOCKS); the module's docstring says why. H200, tools/device/mma18_bench.py (A3B,
# 8 pairs, no L2 reuse, us a launch, median of 200; the numba kernels 12.51 / 11.07): gate|up (1, 8, 4, 2) 12.48,
# (1, 16, 2, 2) 12.54, (1, 8, 2, 3) 11.65 (12 bytes of spills then; 4 since the nineteenth session's gemv<M>: a value
# in L1's stack); down (4, 2, 6, 3) 8.99, (2, 6, 2, 4) 9.04, (1, 2, 6, 8) 8.86. The 48-layer b1 decode (nineteenth
# session, call B, with the projections on tensor cores too): gate|up (1, 8, 2, 3) 495.1 tok/s against (1, 8, 4, 2)'s
# 477.8 / 476.1: the default since
GATE_UP_SHAPE = (1, 8, 2, 3)
DOWN_SHAPE = (1, 2, 6, 8)
# int4: a step is 128 inputs (one group); gate|up (1, 4, 4, 4) 128 registers, no spill: 384 blocks of 128 threads,
# 4 an SM, one wave (32 KB of codes a block); (1, 16, 1, 2) 58; (1, 8, 2, 3) spilled 4 bytes; down (4, 2, 3, 3) 80
# (256 blocks, one wave), (2, 6, 1, 4) 40. H200 (as above; numba 14.08 / 10.75 us): gate|up (1, 4, 4, 4) 10.72,
# (1, 16, 1, 2) 11.30; down (4, 2, 3, 3) 8.18, (2, 6, 1, 4) 7.97. In the 48 x 32 b1 decode (twenty-second session,
# with COMBINE): gate|up (1, 8, 1, 4) (64 registers, two passes of a step a warp: the second pass's words load
# during the first's products; 4 blocks of 256 an SM) 602.1 / 603.0 / 602.0 tok/s, (1, 4, 2, 4) 597.3 / 597.7,
# (1, 4, 4, 4) 583.1 / 583.6 / 583.9, (1, 8, 2, 2) 582.5, (1, 2, 8, 4) 555.3: (1, 8, 1, 4) the default since
INT4_GATE_UP_SHAPE = (1, 8, 1, 4)
INT4_DOWN_SHAPE = (2, 6, 1, 4)
# the routed gate|up (ROUTED) at int4: the twenty-first session's measured shape; at (1, 8, 1, 4) its routing's
# registers spill 8 bytes under the 64-register cap (NVRTC 13.5)
INT4_ROUTED_SHAPE = (1, 4, 4, 4)
# the shapes tools/device/mma18_bench.py times (and the GPU tests check), the defaults first
GATE_UP_SWEEP = ((1, 8, 2, 3), (1, 8, 4, 2), (1, 16, 2, 2))
DOWN_SWEEP = ((1, 2, 6, 8), (4, 2, 6, 3), (2, 6, 2, 4))
INT4_GATE_UP_SWEEP = ((1, 8, 1, 4), (1, 4, 4, 4), (1, 16, 1, 2), (1, 4, 2, 4))
INT4_DOWN_SWEEP = ((2, 6, 1, 4), (4, 2, 3, 3))
VALUES = {"fp8": 16, "int4": 32}  # codes a 16-byte word; a step is 4 words of a row


def shapes(fmt: str) -> tuple[tuple, tuple]:
    """(gate|up shape, down shape) of ``fmt``."""
    return (GATE_UP_SHAPE, DOWN_SHAPE) if fmt == "fp8" else (INT4_GATE_UP_SHAPE, INT4_DOWN_SHAPE)


def routed_shape(fmt: str) -> tuple:
    """The routed gate|up's shape (launch_gate_up_routed) of ``fmt``: route_tail then launch_gate_up at this shape give
    its bits (int4's is not the plain gate|up's default since the twenty-second session)."""
    return tuple(GATE_UP_SHAPE if fmt == "fp8" else INT4_ROUTED_SHAPE)


MAX_GRID_Y = 65535  # pairs a launch (moe_ffn.MAX_GRID_Y)


def compile_options(arch: str, cols: int, rows: int, mats: int, shape: tuple, early: bool = False,
                    fmt: str = "fp8", dense: bool = False, route: int = 0, routed: int = 0, combine: int = 0,
                    normed: bool = False) -> list[bytes]:
    """NVRTC options of one kernel: rows of ``cols`` codes, ``rows`` of each of ``mats`` matrices (2: gate|up,
    1: down), ``shape`` (TILES, KSPLIT, WORDS, MIN_BLOCKS), ``early``: pair tables and codes read before the wait;
    ``fmt`` fp8 or int4; ``dense``: an FP8 dense projection (linear_quant_mma.py; mats 1, fp8); ``route``: with
    ``dense``, the experts of the routing it starts (linear_quant_mma.launch_route; 0: none); ``routed``: gate|up
    ending the routing of that many experts (launch_gate_up_routed; 0: given pair tables); ``combine``: down over
    that many pairs of one token a block, ending in the combine (launch_down_combine); ``normed``: with ``dense``, x
    normalized while staged (linear_quant_mma.launch_normed)."""
    tiles, ksplit, words, min_blocks = shape
    if cols % VALUES[fmt] or 32 * tiles * ksplit * min_blocks > 2048:
        raise ValueError(f"rows of {cols} codes, shape {shape}: whole 16-byte words, at most 2048 threads an SM")
    if dense and (mats != 1 or fmt != "fp8"):
        raise ValueError("a dense projection is one fp8 matrix")
    if route and not (dense and tiles == 1 and rows % 16 == 0 and 0 < route < 32 * ksplit):
        raise ValueError(f"route {route}: a dense projection, a tile a block, whole tiles, fewer experts than threads")
    if routed and not (mats == 2 and not dense and cols % 16 == 0 and 0 < routed <= 32
                       and routed < 32 * tiles * ksplit):
        raise ValueError(f"routed {routed}: gate|up over whole 16-row tiles of the o projection, 1 to 32 experts, "
                         "fewer than the block's threads")
    if combine and not (mats == 1 and not dense and tiles == 1 and rows % 16 == 0 and 0 < combine <= 32
                        and 32 * ksplit * combine <= 1024):
        raise ValueError(f"combine {combine}: down, a 16-row tile a block, whole tiles, at most 1,024 threads")
    if normed and not (dense and not route and cols % 64 == 0):
        raise ValueError("normed: a plain dense projection over whole float4 of 16-row tiles' squares")
    entry = _entry(mats, dense, route, routed, combine, normed)
    return [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"-DCOLS={int(cols)}".encode(),
            f"-DROWS={int(rows)}".encode(), f"-DMATS={int(mats)}".encode(), f"-DTILES={int(tiles)}".encode(),
            f"-DKSPLIT={int(ksplit)}".encode(), f"-DWORDS={int(words)}".encode(),
            f"-DMIN_BLOCKS={int(min_blocks)}".encode(), f"-DEARLY={int(bool(early))}".encode(),
            f"-DPDL_TRIGGER={int(pdl.trigger_after_wait())}".encode(), f"-DENTRY={entry}".encode(),
            f"-DINT4={int(fmt == 'int4')}".encode(), f"-DDENSE={int(dense)}".encode(), f"-DROUTE={int(route)}".encode(),
            f"-DROUTED={int(routed)}".encode(), f"-DCOMBINE={int(combine)}".encode(),
            f"-DNORMED={int(bool(normed))}".encode()]


def _entry(mats: int, dense: bool = False, route: int = 0, routed: int = 0, combine: int = 0,
           normed: bool = False) -> str:
    if dense:
        return ROUTE_ENTRY if route else NORMED_ENTRY if normed else DENSE_ENTRY
    return (ROUTED_ENTRY if routed else GATE_UP_ENTRY) if mats == 2 else COMBINE_ENTRY if combine else DOWN_ENTRY


def source() -> bytes:
    """The .cu with route_sums.cuh (the ROUTED entry's column sums, route_end's too) in place of its #include."""
    from moebus.cuda.kernels.route_end import with_route_sums

    return with_route_sums(SOURCE.read_bytes())


@functools.cache
def _kernel(cols: int, rows: int, mats: int, shape: tuple, early: bool = False, fmt: str = "fp8", dense: bool = False,
            route: int = 0, routed: int = 0, combine: int = 0, normed: bool = False):
    """The compiled kernel for this GPU (cuda.core Kernel), registered as waiting first (pdl.register_waiting):
    a captured graph's edge into it becomes programmatic, as into the numba kernels."""
    from moebus.cuda.kernels.attention_decode_tc import _handles
    from moebus.cuda.kernels.compat import _numba_config, cuda

    gpu = cuda.get_current_device()
    flash_attention._core_device(gpu.id).set_current()  # the primary context, numba's own
    major, minor = gpu.compute_capability
    options = compile_options(f"sm_{major}{minor}", cols, rows, mats, shape, early, fmt, dense, route, routed, combine,
                              normed)
    code = flash_attention.cached_cubin(source(), options, _numba_config.CACHE_DIR, "moe_quant_mma")
    entry = _entry(mats, dense, route, routed, combine, normed)
    name = (f"{entry}_{fmt}_{cols}_{rows}_{'_'.join(map(str, shape))}_{int(early)}_{int(route)}_{int(routed)}"
            f"_{int(combine)}")
    found = flash_attention._object_code().from_cubin(code, name=name).get_kernel(entry)
    pdl.register_waiting(entry.encode(), *_handles(found))
    return found


@functools.cache
def _builds(cols: int, rows: int, mats: int, shape: tuple, early: bool = False, fmt: str = "fp8",
            dense: bool = False, route: int = 0, routed: int = 0, combine: int = 0, normed: bool = False) -> bool:
    try:
        _kernel(cols, rows, mats, shape, early, fmt, dense, route, routed, combine, normed)
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: the numba kernels still work
        log.warning("quantized GEMVs on tensor cores unavailable (%s)", exc)
        return False
    return True


def fits(layout, chunk: int) -> bool:
    """The shapes these kernels take: fp8 or int4 experts, runs of one pair, rows of whole 16-byte words, matrices'
    codes at 16-byte offsets, scales at 8-byte ones (int4's (scale, minimum) pairs), a blob of whole 16-byte words."""
    values = VALUES.get(layout.dtype)
    offsets = layout.kernel_words()  # 4-byte units
    return (values is not None and chunk == 1 and layout.hidden % values == 0 and layout.inter % values == 0
            and all(4 * o % 16 == 0 for o in offsets[:3])
            and (layout.dtype == "fp8" or all(4 * o % 8 == 0 for o in offsets[3:]))
            and layout.blob_bytes % 16 == 0)


def _gpu_ok() -> bool:
    """A GPU (not the simulator) with the e4m3 pair conversion (sm_89+; quant_words', cached: asked every layer)."""
    from moebus.cuda.kernels.quant_words import can_convert_e4m3

    return can_convert_e4m3()


def _stream_object(stream) -> bool:
    return hasattr(stream, "__cuda_stream__") or hasattr(stream, "end_building")  # a cuda.core launch: not 0


def takes(layout, chunk: int, arena, store, stream) -> bool:
    """Whether expert_ffn_quant_cuda runs these kernels: the format in FORMATS, ``fits``, 16-byte aligned blobs, a
    GPU that converts e4m3 pairs (sm_89+, int4 too), a stream object, both kernels built (a failure warns once: the
    numba kernels run)."""
    from moebus.cuda.kernels.moe_quant_round import aligned

    fmt = layout.dtype
    gate_up, down = shapes(fmt)
    return (fmt in FORMATS and fits(layout, chunk) and _stream_object(stream) and _gpu_ok() and aligned(arena, store)
            and _builds(layout.hidden, layout.inter, 2, tuple(gate_up), False, fmt)
            and _builds(layout.inter, layout.hidden, 1, tuple(down), _early(), fmt))


def takes_routed(layout, num_experts: int, top_k: int, arena, store, stream) -> bool:
    """Whether the routed decode's gate|up ends the routing (launch_gate_up_routed; ROUTED, read at each call):
    ``takes`` at batch 1, 1 <= top_k <= experts <= 32 (one_token_tail's warp), the kernel built."""
    shape = routed_shape(layout.dtype) if layout.dtype in VALUES else ()
    return (ROUTED and 0 < top_k <= num_experts <= 32 and takes(layout, 1, arena, store, stream)
            and 32 * shape[0] * shape[1] > num_experts
            and _builds(layout.hidden, layout.inter, 2, shape, False, layout.dtype, routed=num_experts))


def _early() -> bool:
    """The down GEMV's pair tables and codes read before its wait: the step's choice for the numba kernels
    (moe_quant_round.choose_down_early: every expert resident, no loan) and pdl.released_early."""
    from moebus.cuda.kernels import moe_quant_round

    return bool(moe_quant_round._down_early and pdl.released_early())


def grid_x(rows: int, shape: tuple) -> int:
    """Blocks along the rows: ceil(16-row tiles / TILES)."""
    return ceil_div(ceil_div(rows, 16), shape[0])


def launch(x, pair_token, pair_slot, pair_out, arena, store, layout, h, out, stream, gate_up_shape=None,
           down_shape=None, early=None) -> None:
    """h[j] = silu(gate x[pair_token[j]]) * up x[...], then out[pair_out[j]] = down h[j], for every pair j
    (expert_ffn_quant_ref's results within the module's bound). x (T, D), h (J, I) and out (P, D) float32,
    C-ordered; arena / store (slots, B) uint8 blobs of ``layout``; ``stream``: a numba stream or a GraphBuilder.
    The shapes and ``early``: the module's (the bench sweeps them)."""
    launch_gate_up(x, pair_token, pair_slot, pair_out, arena, store, layout, h, stream, gate_up_shape)
    launch_down(h, pair_token, pair_slot, pair_out, arena, store, layout, out, stream, down_shape, early)


def _pointer(array) -> np.intp:
    """Any device array's address (__cuda_array_interface__: the host store's mapped view too)."""
    return np.intp(data_ptr(array))


def _blobs(arena, store, layout) -> tuple:
    return _pointer(arena), _pointer(store), np.int64(layout.blob_bytes)


def launch_gate_up(x, pair_token, pair_slot, pair_out, arena, store, layout, h, stream, shape=None) -> None:
    """h[j] = silu(gate x[pair_token[j]]) * up x[pair_token[j]] for every pair j (``launch``'s first kernel)."""
    shape = tuple(shape or shapes(layout.dtype)[0])
    code0, code1, _, scale0, scale1, _ = (np.int64(4 * o) for o in layout.kernel_words())
    kernel = _kernel(layout.hidden, layout.inter, 2, shape, False, layout.dtype)
    _launch_pairs(stream, kernel, layout.inter, shape, x, pair_token, pair_slot, arena, store, layout,
                  (code0, code1, scale0, scale1), pair_out, h)


def launch_gate_up_routed(total, partial, norm_weight, eps: float, table, layer_row: int, top_k: int, normalize: bool,
                          arena, store, layout, ids, weights, pair_token, pair_slot, pair_out, h, stream,
                          shape=None) -> None:
    """norm_route.route_tail_cuda's outputs but h (ids and weights (1, top_k), the pair tables (top_k,)) and
    h[j] = silu(gate x) * up x of pair j, x = route_tail's h of ``total`` (1, D) and the ROUTE entry's ``partial``
    (D / 16, E + 1), in one launch: every block ranks the experts itself (the module's ROUTED). ``table``: the
    placement (layers, E) int32; ``h`` (top_k, I) float32."""
    shape = tuple(shape or routed_shape(layout.dtype))
    num_experts = partial.shape[1] - 1
    code0, code1, _, scale0, scale1, _ = (np.int64(4 * o) for o in layout.kernel_words())
    kernel = _kernel(layout.hidden, layout.inter, 2, shape, False, layout.dtype, routed=num_experts)
    ptr = _pointer
    flash_attention._core_launch(stream, (grid_x(layout.inter, shape), int(top_k)), 32 * shape[0] * shape[1], kernel,
                                 ptr(total), _partials(partial), ptr(norm_weight), np.float32(eps),
                                 _table_row(table, layer_row), np.int32(top_k), np.int32(bool(normalize)),
                                 *_blobs(arena, store, layout), code0, code1, scale0, scale1, ptr(ids), ptr(weights),
                                 ptr(pair_token), ptr(pair_slot), ptr(pair_out), ptr(h))


def _partials(partial) -> np.intp:
    """The ROUTE entry's partials, read 16 bytes a thread."""
    at = _pointer(partial)
    if at % 16 or not partial.flags["C_CONTIGUOUS"]:
        raise ValueError("the routed gate|up reads the partials 16 bytes a thread: a C-ordered, 16-byte aligned array")
    return at


def _table_row(table, layer_row: int) -> np.intp:
    """The address of the placement's row ``layer_row`` (layers, E) int32."""
    return np.intp(int(_pointer(table)) + int(layer_row) * table.strides[0])


def launch_down(h, pair_token, pair_slot, pair_out, arena, store, layout, out, stream, shape=None, early=None) -> None:
    """out[pair_out[j]] = down h[j] for every pair j (``launch``'s second kernel); ``early``: its pair tables and
    codes read before its wait (None: the step's choice, ``_early``)."""
    shape = tuple(shape or shapes(layout.dtype)[1])
    early = _early() if early is None else early
    _, _, code2, _, _, scale2 = (np.int64(4 * o) for o in layout.kernel_words())
    kernel = _kernel(layout.inter, layout.hidden, 1, shape, early, layout.dtype)
    _launch_pairs(stream, kernel, layout.hidden, shape, h, pair_token, pair_slot, arena, store, layout,
                  (code2, code2, scale2, scale2), pair_out, out)


def _launch_pairs(stream, kernel, rows: int, shape: tuple, x, pair_token, pair_slot, arena, store, layout, offsets,
                  pair_out, out) -> None:
    """``kernel`` over every pair, MAX_GRID_Y pairs a launch; ``offsets``: (code0, code1, scale0, scale1)."""
    ptr, num_pairs = _pointer, pair_slot.shape[0]
    for first in range(0, num_pairs, MAX_GRID_Y):
        flash_attention._core_launch(stream, (grid_x(rows, shape), min(MAX_GRID_Y, num_pairs - first)),
                                     32 * shape[0] * shape[1], kernel, ptr(x), ptr(pair_token), ptr(pair_slot),
                                     *_blobs(arena, store, layout), *offsets, np.int32(first), ptr(pair_out), ptr(out))


def combine_shape(fmt: str) -> tuple:
    return tuple(COMBINE_SHAPES[fmt])


def takes_combine(layout, top_k: int, arena, store, stream, early: bool | None = None) -> bool:
    """Whether the routed decode's down GEMV ends in the combine (launch_down_combine; COMBINE, read at each call):
    ``takes`` at batch 1, top_k pairs in a block of at most 1,024 threads, hidden rows in whole 16-row tiles and
    whole float4 of tiles (the NORMED projection's squares), the kernel built with ``early`` (None: the step's)."""
    if not (COMBINE and layout is not None and layout.dtype in COMBINE_SHAPES and 0 < top_k):
        return False
    shape = combine_shape(layout.dtype)
    early = _early() if early is None else early
    return (32 * shape[1] * top_k <= 1024 and layout.hidden % 64 == 0 and takes(layout, 1, arena, store, stream)
            and _builds(layout.inter, layout.hidden, 1, shape, early, layout.dtype, combine=int(top_k)))


def launch_down_combine(h, pair_slot, pair_out, weights, arena, store, layout, residual, total, square, stream,
                        shape=None, early=None) -> None:
    """total (1, D) = residual + sum over ranks k of weights[0, k] * down h[j] (pair j of rank pair_out[j]: one
    token's top_k pairs), square (D / 16,) the 16-row tiles' sums of total^2: launch_down then
    fused.combine_add_rmsnorm's residual add, in one launch. h (top_k, I) float32, its rows 16-byte aligned;
    ``early``: the tables, weights, residual and codes read before the wait (None: the step's choice, ``_early``)."""
    shape = tuple(shape or combine_shape(layout.dtype))
    early = _early() if early is None else early
    top_k = pair_slot.shape[0]
    _, _, code2, _, _, scale2 = (np.int64(4 * o) for o in layout.kernel_words())
    kernel = _kernel(layout.inter, layout.hidden, 1, shape, early, layout.dtype, combine=int(top_k))
    ptr = _pointer
    flash_attention._core_launch(stream, (layout.hidden // 16, 1), 32 * shape[1] * top_k, kernel, ptr(h),
                                 ptr(pair_slot), ptr(pair_out), ptr(weights), *_blobs(arena, store, layout), code2,
                                 scale2, ptr(residual), ptr(total), ptr(square))
