"""Fused (flash) attention on tensor cores (flash_attention.cu): causal prefill over a bf16 KV cache
(the chunk's own keys plus its earlier context, GQA, a sliding window) and bidirectional attention
over each image's float32 patches (the vision towers). Scores and probabilities stay on the SM: no
scratch, one launch per sequence (prefill) or per call (images).

The kernel is CUDA C++ compiled by NVRTC at run time (cuda-bindings) for this GPU, one cubin per
(head dim, key type), kept on disk beside numba's kernels (its name hashes the source, the options,
the architecture and NVRTC's version), loaded and launched through cuda.core on the backend's
stream, or into the GraphBuilder that captures it. If it cannot be built (no NVRTC), ``ready`` warns
once and says no: prefill_attention.py keeps its materialised path. Why not a numba kernel calling a linked C++
device function: numba cannot keep kernels with linked files in its disk cache, so every worker
start would pay NVRTC again.

Precision: split bf16 parts, fp32 sums (the .cu's header); flash_attention_ref.py is the same
arithmetic in numpy. The images' products may instead be plain bf16 (IMAGE_PRECISION, below): the
towers' choice, measured against the split one for time and fidelity (docs/performance.md).
Shapes: T rows, H query heads, KVH kv heads, hd head dim, C cache positions."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.launch import ceil_div, require

log = logging.getLogger("moebus.cuda")
SOURCE = Path(__file__).with_suffix(".cu")
PLANES = SOURCE.with_name("flash_planes.cuh")  # what float32 keys take: included by the .cu
INCLUDE = b'#include "flash_planes.cuh"'
ENTRY, PLANES_ENTRY, ROPE_ENTRY = "flash_attention", "split_planes", "rope_planes"
WARPS = 4  # warps per block, 16 queries each (the .cu's WARPS): prefill
IMAGE_WARPS = int(os.environ.get("MOEBUS_FLASH_IMAGE_WARPS", "8"))  # images: 8 (measured faster, vltower7) or 4
# images: query rows a warp (the .cu's WARP_ROWS): 16, or 32 (two m-tiles sharing each key and value
# fragment read from shared memory; float32 keys of up to 96 dims); a row's results are the same. 16: at
# 3072 patches 32 rows measured slower on the H200 (0.614 ms at 4 warps, 0.600 at 8, against 0.560; vltower10)
IMAGE_WARP_ROWS = int(os.environ.get("MOEBUS_FLASH_IMAGE_WARP_ROWS", "16"))
BLOCK_QUERIES = 16 * WARPS  # the .cu's BM
PLANE_KEYS, PLANE_THREADS = 64, 256  # split_planes: keys per block (the .cu's PLANE_KEYS), threads
MAX_HEAD_DIM = 128
ENABLED = os.environ.get("MOEBUS_ATTENTION_FLASH", "1") != "0"
# Images' products: "split" (Q K and P V on split bf16 parts, 3 mma each: ~fp32), "split_scores"
# (Q K split, P V plain bf16) or "bf16" (both plain: one mma each). Prefill is always split.
PRECISIONS = {"split": (1, 1), "split_scores": (1, 0), "bf16": (0, 0)}  # -> (SPLIT_QK, SPLIT_PV)
IMAGE_PRECISION = os.environ.get("MOEBUS_IMAGE_ATTENTION", "split")
# images: more of the .cu's compile-time settings, as (name, value) pairs: MIN_BLOCKS (blocks an SM
# must hold), STAGES_WANTED (1: no cp.async double buffering), TILE_KEYS (keys per tile); the A/B
# knobs of tools/device/vltower8_encode.py
# MOEBUS_FLASH_HALF_KSTEP=0: hd 72's last 8 dims of Q K^T on an m16n8k16 over zero padding instead of an
# m16n8k8 (HALF_KSTEP in flash_planes.cuh; default on: on the H200 its outputs equal the k16 path's bit for bit,
# vltower10)
IMAGE_DEFINES: tuple = () if os.environ.get("MOEBUS_FLASH_HALF_KSTEP", "1") != "0" else (("HALF_KSTEP", 0),)
# the tower's rope_planes takes a thread per rotary pair, each q and k element read once (ROPE_PAIRS in
# flash_planes.cuh; the same values: on the H200 42.6 -> 38.0 us a call, the a3b tower's outputs bit for bit,
# fifteenth session); MOEBUS_FLASH_ROPE_PAIRS=0: a thread per dim
IMAGE_DEFINES += (("ROPE_PAIRS", 1),) if os.environ.get("MOEBUS_FLASH_ROPE_PAIRS", "1") != "0" else ()


def supported(head_dim: int) -> bool:
    """Head dims the kernel is built for: multiples of 8 up to 128 (others keep the cuBLAS path)."""
    return not SIMULATOR and ENABLED and head_dim % 8 == 0 and 8 <= head_dim <= MAX_HEAD_DIM


# -- compiling ------------------------------------------------------------------------------------

def compile_options(head_dim: int, f32_kv: bool, arch: str, warps: int = WARPS,
                    precision: str = "split", defines: tuple = (), warp_rows: int = 16) -> list[bytes]:
    if warps not in (4, 8):
        raise ValueError(f"{warps} warps a block: the kernel is built for 4 or 8")
    if warp_rows not in (16, 32) or (warp_rows == 32 and not (f32_kv and head_dim <= 96)):
        raise ValueError(f"{warp_rows} query rows a warp: 16, or 32 for float32 keys of up to 96 dims")
    split_qk, split_pv = _splits(precision)
    return [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"-DHEAD_DIM={int(head_dim)}".encode(),
            f"-DF32_KV={int(bool(f32_kv))}".encode(), f"-DWARPS={int(warps)}".encode(),
            f"-DSPLIT_QK={split_qk}".encode(), f"-DSPLIT_PV={split_pv}".encode()] + \
        [f"-DWARP_ROWS={int(warp_rows)}".encode()] * (warp_rows != 16) + \
        [f"-D{name}={int(value)}".encode() for name, value in defines]


def _splits(precision: str) -> tuple[int, int]:
    if precision not in PRECISIONS:
        raise ValueError(f"image attention precision {precision!r}: one of {', '.join(PRECISIONS)} "
                         "(MOEBUS_IMAGE_ATTENTION)")
    return PRECISIONS[precision]


def source() -> bytes:
    """The kernels' CUDA C++: the .cu with flash_planes.cuh in place of its #include (one text, so
    the cubin's name hashes both)."""
    main = SOURCE.read_bytes()
    if INCLUDE not in main:
        raise RuntimeError(f"{SOURCE.name} lacks {INCLUDE.decode()}")
    return main.replace(INCLUDE, PLANES.read_bytes(), 1)


def nvrtc_compile(source: bytes, options: list[bytes], target: str = "cubin") -> tuple[bytes, str]:
    """(the cubin or PTX of ``source``, NVRTC's log); RuntimeError with the log if it fails."""
    from cuda.bindings import nvrtc

    err, program = nvrtc.nvrtcCreateProgram(source, b"flash_attention.cu", 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        log_text = _program_log(nvrtc, program)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC could not compile flash_attention.cu ({err}):\n{log_text}")
        size_of, get = ((nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if target == "cubin"
                        else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX))
        err, size = size_of(program)
        _check(nvrtc, err, "size")
        buffer = bytearray(size)  # never b" " * size: at size 1 that is CPython's shared b" ", overwritten
        (err,) = get(program, buffer)
        _check(nvrtc, err, "get")
        return bytes(buffer), log_text
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _program_log(nvrtc, program) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(program)
    buffer = bytearray(size)  # an empty log is 1 byte: b" " * 1 would be the interpreter's shared b" "
    nvrtc.nvrtcGetProgramLog(program, buffer)
    return bytes(buffer).rstrip(b"\0 ").decode(errors="replace")


def _check(nvrtc, err, what: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC {what}: {err}")


def cubin(head_dim: int, f32_kv: bool, arch: str, cache_dir: str | None, warps: int = WARPS,
          precision: str = "split", defines: tuple = (), warp_rows: int = 16) -> bytes:
    """The kernel's cubin for ``arch`` (e.g. sm_90): from ``cache_dir``/flash_attention if compiled
    before (the name hashes the source, the options and NVRTC's version), else NVRTC, then kept there."""
    options = compile_options(head_dim, f32_kv, arch, warps, precision, defines, warp_rows)
    return cached_cubin(source(), options, cache_dir, "flash_attention")


def cached_cubin(text: bytes, options: list[bytes], cache_dir: str | None, kind: str) -> bytes:
    """NVRTC's cubin of ``text``, kept in ``cache_dir``/``kind`` (the name hashes the source, the options and
    NVRTC's version) and read from there when compiled before; no cache_dir: compiled each time."""
    from cuda.bindings import nvrtc

    path = None
    if cache_dir:
        digest = hashlib.sha256(text + b"\0".join(options) + repr(nvrtc.nvrtcVersion()).encode()).hexdigest()
        path = Path(cache_dir) / kind / f"{digest[:24]}.cubin"
        if path.is_file():
            return path.read_bytes()
    code, _ = nvrtc_compile(text, options)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(code)
        os.replace(partial, path)  # whole or absent: a reader never sees half a file
    return code


def _warps(f32_kv: bool) -> int:
    return IMAGE_WARPS if f32_kv else WARPS  # float32 keys: the towers' images


def _precision(f32_kv: bool) -> str:
    return IMAGE_PRECISION if f32_kv else "split"


def _defines(f32_kv: bool) -> tuple:
    return tuple(IMAGE_DEFINES) if f32_kv else ()


def warp_rows(head_dim: int, f32_kv: bool) -> int:
    """Query rows a warp takes: IMAGE_WARP_ROWS for float32 keys where the .cu has 32 (up to 96
    dims), else 16 (prefill always)."""
    return IMAGE_WARP_ROWS if f32_kv and head_dim <= 96 else 16


def block_queries(head_dim: int, f32_kv: bool) -> int:
    """Queries a block of the kernel takes (the .cu's BM)."""
    return warp_rows(head_dim, f32_kv) * _warps(f32_kv)


@functools.cache
def _module(head_dim: int, f32_kv: bool, warps: int, precision: str, defines: tuple, rows: int = 16):
    """The compiled cubin for this GPU (cuda.core ObjectCode), through numba's kernel cache directory."""
    from moebus.cuda.kernels.compat import _numba_config, cuda

    gpu = cuda.get_current_device()
    _core_device(gpu.id).set_current()  # the primary context, numba's own
    major, minor = gpu.compute_capability
    code = cubin(head_dim, f32_kv, f"sm_{major}{minor}", _numba_config.CACHE_DIR, warps, precision, defines, rows)
    name = f"flash_attention_hd{head_dim}_{int(f32_kv)}_{warps}w{rows}r_{precision}" + \
        "".join(f"_{v}" for _, v in defines)
    return _object_code().from_cubin(code, name=name)


def _kernel(head_dim: int, f32_kv: bool, entry: str = ENTRY):
    """One entry of the compiled kernels (cuda.core Kernel): the attention or split_planes."""
    return _module(head_dim, f32_kv, _warps(f32_kv), _precision(f32_kv), _defines(f32_kv),
                   warp_rows(head_dim, f32_kv)).get_kernel(entry)


def ready(head_dim: int, f32_kv: bool) -> bool:
    """supported() and the kernel compiled (or loaded) for this GPU; if that fails (no NVRTC, say),
    a warning once and False: the caller keeps the materialised path."""
    _splits(_precision(f32_kv))  # a bad MOEBUS_IMAGE_ATTENTION is an error, not a quiet fallback
    return supported(head_dim) and _builds(head_dim, f32_kv)


@functools.cache
def _builds(head_dim: int, f32_kv: bool) -> bool:
    try:
        _kernel(head_dim, f32_kv)
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: the other path still works
        log.warning("flash attention unavailable for head dim %d (%s): attention materialises its scores",
                    head_dim, exc)
        return False
    return True


def _core_device(index: int):
    try:
        from cuda.core import Device
    except ImportError:  # cuda.core < 1.0
        from cuda.core.experimental import Device
    return Device(index)


def _object_code():
    try:
        from cuda.core import ObjectCode
    except ImportError:  # cuda.core < 1.0
        from cuda.core.experimental import ObjectCode
    return ObjectCode


def _core_launch(stream, grid: tuple, threads: int, kernel, *args) -> None:
    try:
        from cuda.core import LaunchConfig, launch
    except ImportError:  # cuda.core < 1.0
        from cuda.core.experimental import LaunchConfig, launch
    from moebus.cuda.backends.graphs import _core_stream

    target = stream if hasattr(stream, "end_building") else _core_stream(stream)  # a GraphBuilder, or numba's
    launch(target, LaunchConfig(grid=grid, block=threads), kernel, *args)


def _pointer(array) -> np.intp:
    return np.intp(array.device_ctypes_pointer.value or 0)


# -- launching ------------------------------------------------------------------------------------

def _launch(stream, q, k, v, out, f32_kv: bool, q_row0: int, rows_per_z: int, num_queries: int, group: int,
            strides: tuple, num_keys: int, first_pos: int, window: int, causal: bool, scale: float,
            num_z: int = 1, out_parts: int = 0) -> None:
    _, heads, head_dim = q.shape
    k_base, k_z_stride, k_head_stride, k_row_stride = (np.int64(s) for s in strides)
    kernel, warps = _kernel(head_dim, f32_kv), _warps(f32_kv)
    grid = (ceil_div(num_queries, block_queries(head_dim, f32_kv)), heads, num_z)
    _core_launch(stream, grid, 32 * warps, kernel, _pointer(q), _pointer(k), _pointer(v), _pointer(out),
                 np.int32(q_row0), np.int32(rows_per_z), np.int32(num_queries), np.int32(heads), np.int32(group),
                 k_base, k_z_stride, k_head_stride, k_row_stride, np.int32(num_keys), np.int32(first_pos), np.int32(window),
                 np.int32(bool(causal)), np.float32(scale * np.log2(np.e)), np.int32(out_parts))


def flash_prefill_cuda(q, k_cache, v_cache, segments, scale: float, window: int, out, stream):
    """out (T, H, hd) = attention_ref(...) for the step's sequences ``segments``: host tuples (first
    row, cache slot, start position, length), their keys already in the bf16 caches (S, KVH, C, hd)."""
    require("q", q, np.float32, ndim=3)
    require("out", out, np.float32, shape=tuple(q.shape))
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        require(name, cache, np.uint16, ndim=4)
    _, heads, head_dim = q.shape
    slots, kv_heads, context, cache_dim = k_cache.shape
    if cache_dim != head_dim or heads % kv_heads or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"q {tuple(q.shape)} against caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    for row0, slot, start, length in segments:
        if not (0 <= slot < slots and start >= 0 and start + length <= context and 0 <= row0 <= q.shape[0] - length):
            raise ValueError(f"segment {(row0, slot, start, length)} outside q {tuple(q.shape)} or the cache")
        if length:
            strides = (slot * kv_heads * context * head_dim, 0, context * head_dim, head_dim)
            _launch(stream, q, k_cache, v_cache, out, False, row0, 0, length, heads // kv_heads, strides,
                    start + length, start, window or 0, True, scale)
    return out


def plane_shapes(num_images: int, positions: int, heads: int, head_dim: int) -> tuple[tuple, tuple]:
    """Shapes of split_planes' bf16 planes (uint16) of the keys and the values of an image call."""
    keys_padded, padded_dim = ceil_div(positions, PLANE_KEYS) * PLANE_KEYS, ceil_div(head_dim, 16) * 16
    return (num_images, heads, 2, keys_padded, padded_dim), (num_images, heads, 2, head_dim, keys_padded)


def split_planes_cuda(k, v, num_images: int, k_planes, v_planes, stream):
    """k, v (N P, H, hd) float32 -> their bf16 planes (plane_shapes): keys (N, H, 2, P', hd') hi and
    lo, zero past P and hd; values transposed (N, H, 2, hd, P'), zero past P (flash_attention.cu)."""
    rows, heads, head_dim = k.shape
    positions = rows // num_images
    k_shape, v_shape = plane_shapes(num_images, positions, heads, head_dim)
    require("k_planes", k_planes, np.uint16, shape=k_shape)
    require("v_planes", v_planes, np.uint16, shape=v_shape)
    kernel = _kernel(head_dim, True, PLANES_ENTRY)
    _core_launch(stream, (k_shape[3] // PLANE_KEYS, heads, num_images), PLANE_THREADS, kernel, _pointer(k), _pointer(v),
                 _pointer(k_planes), _pointer(v_planes), np.int32(positions), np.int32(k_shape[3]), np.int32(heads))
    return k_planes, v_planes


def rope_planes_cuda(q, k, v, bias, rope_pos, axes, cos, sin, num_images: int, q_out, k_planes, v_planes, stream):
    """The tower's rotary and the qkv product's biases, then split_planes, in one pass: q, k, v (N P,
    H, hd) float32 without their biases, bias (3 H hd,) bf16 bits (q's, k's, v's), the rotary's
    rope_pos (N P, A) int32, axes (hd/2,) int32 < A, cos and sin (., hd/2) float32 ->
    q_out = mrope_ref(q, rope_pos, axes, cos, sin, q's bias) and the planes of that of k and of
    v + v's bias (flash_attention_ref.rope_planes_ref)."""
    from moebus.cuda.kernels.vision_attention import image_rows

    rows, heads, head_dim = image_rows(q, k, v, q_out, num_images)
    positions = rows // num_images
    k_shape, v_shape = plane_shapes(num_images, positions, heads, head_dim)
    require("k_planes", k_planes, np.uint16, shape=k_shape)
    require("v_planes", v_planes, np.uint16, shape=v_shape)
    require("bias", bias, np.uint16, shape=(3 * heads * head_dim,))
    require("rope_pos", rope_pos, np.int32, shape=(rows, None))
    require("axes", axes, np.int32, shape=(head_dim // 2,))
    require("cos", cos, np.float32, shape=(None, head_dim // 2))
    require("sin", sin, np.float32, shape=tuple(cos.shape))
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim}: the rotary turns pairs")
    if positions:
        kernel = _kernel(head_dim, True, ROPE_ENTRY)
        _core_launch(stream, (k_shape[3] // PLANE_KEYS, heads, num_images), PLANE_THREADS, kernel, _pointer(q),
                     _pointer(k), _pointer(v), _pointer(bias), _pointer(rope_pos), np.int32(rope_pos.shape[1]),
                     _pointer(axes), _pointer(cos), _pointer(sin), _pointer(q_out), _pointer(k_planes),
                     _pointer(v_planes), np.int32(positions), np.int32(k_shape[3]), np.int32(heads))
    return q_out, k_planes, v_planes


def flash_planes_cuda(q, k_planes, v_planes, num_images: int, scale: float, out, stream):
    """out = attention of q (N P, H, hd) float32 over the keys and values whose planes split_planes
    (or rope_planes) wrote: the fused kernel alone. ``out``: (N P, H, hd) float32, or the split
    input of the product that reads it next, (parts, N P, H hd) bf16 bits as gemm.split_rows writes
    them (parts 1 or 2)."""
    rows, heads, head_dim = q.shape
    require("q", q, np.float32, ndim=3)
    out_parts = 0
    if np.dtype(out.dtype) == np.uint16:
        require("out", out, np.uint16, shape=(None, rows, heads * head_dim))
        out_parts = out.shape[0]
        if out_parts not in (1, 2):
            raise ValueError(f"out: {out_parts} parts, expected 1 or 2")
    else:
        require("out", out, np.float32, shape=tuple(q.shape))
    positions = rows // num_images
    shapes = plane_shapes(num_images, positions, heads, head_dim)
    require("k_planes", k_planes, np.uint16, shape=shapes[0])
    require("v_planes", v_planes, np.uint16, shape=shapes[1])
    if positions:
        strides = (0, 0, 0, shapes[0][3])  # the kernel reads the planes' keys_padded from k_row_stride
        _launch(stream, q, k_planes, v_planes, out, True, 0, positions, positions, 1, strides, positions, 0, 0, False,
                scale, num_z=num_images, out_parts=out_parts)
    return out


def flash_images_cuda(q, k, v, num_images: int, scale: float, out, stream, planes=None):
    """out = vision_attention_ref(q, k, v, num_images, scale): rows (N P, H, hd) float32, each image's
    P rows attending to each other. ``planes``: scratch for the keys' and values' bf16 planes
    (plane_shapes, uint16; the caller's pool), else allocated here."""
    from moebus.cuda.kernels.compat import cuda
    from moebus.cuda.kernels.vision_attention import image_rows

    rows, heads, head_dim = image_rows(q, k, v, out, num_images)
    positions = rows // num_images
    if positions:
        shapes = plane_shapes(num_images, positions, heads, head_dim)
        if planes is None:
            planes = tuple(cuda.device_array(shape, np.uint16) for shape in shapes)
        k_planes, v_planes = split_planes_cuda(k, v, num_images, *planes, stream)
        flash_planes_cuda(q, k_planes, v_planes, num_images, scale, out, stream)
    return out
