"""Compile every kernel variant the cuda backend launches to PTX for a real GPU (sm_90 by default),
with NVVM but without a GPU, driver or NVRTC: the simulator tests cannot see GPU-only code (libdevice,
shuffles, numba's typing of them). Each launch wrapper runs on numpy arrays with launches intercepted;
every kernel it would launch is compiled for the argument types it would get. Then the PTX is
checked for double-precision arithmetic (a float64 literal slipped into a float32 kernel) and for
local-memory traffic (a per-thread array that did not end up in registers); where the toolkit has
ptxas, also that registers x threads per block fit the SM (else the launch fails on the GPU).

    python -m tests.cuda.ptx_check [--cuda-home /usr/local/cuda] [--cc 9.0] [--dump DIR]

Must run in a process where numba has not been imported with NUMBA_ENABLE_CUDASIM=1."""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from collections import namedtuple
from types import SimpleNamespace

import numpy as np

F64_OP = re.compile(r"^\s*(add|sub|mul|fma|div|sqrt|rcp|ex2|lg2|max|min|neg|abs)(\.[a-z]+)*\.f64\b", re.M)
LOCAL_OP = re.compile(r"^\s*(ld|st)\.local\b", re.M)
REGISTERS_PER_SM = 65536
# attention_decode's settings compiled beside its defaults: the first names every key the others set
DECODE_SETTINGS = ({"FAST_EXP": True, "MAX_HEADS_PER_WARP": 4, "ROWS_AHEAD": 2, "MERGE_SPLITS": 4, "L2_AHEAD": 64,
                    "MIN_BLOCKS": 2, "OWNER_SOFTMAX": False, "DECODE_SPLITS": 64, "WIDE_MERGE": True,
                    "MERGE_IN_SPLIT": True},
                   {"WIDE_MERGE": False},
                   {"DECODE_SPLITS": 256, "MERGE_SPLITS": 8},
                   {"DECODE_SPLITS": 256, "MERGE_SPLITS": 16, "MERGE_IN_SPLIT": False},
                   {"DECODE_SPLITS": 128, "ROWS_AHEAD": 8, "MIN_BLOCKS": 1},
                   {"FAST_EXP": True, "MAX_HEADS_PER_WARP": 4, "ROWS_AHEAD": 4, "MERGE_SPLITS": 4, "L2_AHEAD": 0,
                    "MIN_BLOCKS": 0},
                   {"FAST_EXP": False, "MAX_HEADS_PER_WARP": 4, "ROWS_AHEAD": 2, "MERGE_SPLITS": 4, "L2_AHEAD": 64},
                   {"FAST_EXP": True, "MAX_HEADS_PER_WARP": 8, "ROWS_AHEAD": 2, "MERGE_SPLITS": 4, "L2_AHEAD": 64},
                   {"FAST_EXP": True, "MAX_HEADS_PER_WARP": 2, "ROWS_AHEAD": 4, "MERGE_SPLITS": 4, "L2_AHEAD": 64},
                   {"OWNER_SOFTMAX": True},
                   {"OWNER_SOFTMAX": True, "FAST_EXP": True, "L2_AHEAD": 64, "MIN_BLOCKS": 2},
                   {"OWNER_SOFTMAX": True, "FAST_EXP": True, "MAX_HEADS_PER_WARP": 8})
MAX_STATIC_SHARED = 48 * 1024


def find_cuda_home() -> str | None:
    for root in [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                 *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]:
        if root and glob.glob(os.path.join(root, "nvvm/libdevice/libdevice*.bc")) and _libnvvm(root):
            return root
    return None


def _libnvvm(root: str) -> str | None:
    found = sorted(glob.glob(os.path.join(root, "lib*/libnvvm.so*")) + glob.glob(os.path.join(root, "nvvm/lib64/libnvvm.so*")))
    return found[0] if found else None


def _offline_numba(cuda_home: str, cc: tuple[int, int]):
    """numba.cuda set up to compile with this toolkit's NVVM for ``cc``, no driver involved."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        raise SystemExit("ptx_check needs the real numba.cuda: unset NUMBA_ENABLE_CUDASIM")
    from moebus.cuda.kernels import compat  # noqa: F401 - numpy shims first
    from numba.cuda import cuda_paths
    import numba.cuda.compiler as compiler
    import numba.cuda.dispatcher as dispatcher
    from numba.cuda.cudadrv import nvrtc

    path = namedtuple("path", "by info")
    libdevice = sorted(glob.glob(os.path.join(cuda_home, "nvvm/libdevice/libdevice*.bc")))[0]
    lib = os.path.dirname(_libnvvm(cuda_home))
    cuda_paths.get_cuda_paths._cached_result = {
        "nvrtc": path("ptx_check", None), "nvvm": path("ptx_check", _libnvvm(cuda_home)),
        "libdevice": path("ptx_check", libdevice), "cudalib_dir": path("ptx_check", lib),
        "static_cudalib_dir": path("ptx_check", lib), "include_dir": path("ptx_check", os.path.join(cuda_home, "include"))}
    nvrtc.get_arch_option = lambda major, minor: f"compute_{major}{minor}"
    device = SimpleNamespace(compute_capability=cc)
    dispatcher.get_current_device = compiler.get_current_device = lambda: device
    return dispatcher.CUDADispatcher


def _numba_type(arg) -> str:
    if isinstance(arg, np.ndarray):
        if not arg.flags.c_contiguous:
            raise TypeError("kernels only take C-contiguous arrays")
        return f"{arg.dtype.name}[{', '.join([':'] * (arg.ndim - 1) + ['::1'])}]"
    if isinstance(arg, (bool, np.bool_)):
        return "boolean"
    if isinstance(arg, np.generic):
        return arg.dtype.name
    if isinstance(arg, int):
        return "int64"
    if isinstance(arg, float):
        return "float64"
    if isinstance(arg, tuple) and arg and all(isinstance(a, int) for a in arg):
        return f"UniTuple(int64, {len(arg)})"
    raise TypeError(f"no kernel argument type for {type(arg)}")


class Compiler:
    def __init__(self, cc, dump_dir=None, shard=(0, 1)):
        self.cc = cc
        self.dump_dir = dump_dir
        self.shard = shard  # (i, n): compile only the i-th of every n variants, in order of first launch
        self.seen = {}  # (kernel, signature, id) -> order of first launch
        self.results = {}  # same key -> (ptx or None, error)
        self.threads = {}  # same key -> most threads per block it is launched with

    def launch(self, kernel, config, args):
        from numba import cuda

        signature = f"void({', '.join(_numba_type(a) for a in args)})"
        key = (kernel.py_func.__qualname__, signature, id(kernel))
        block = config[1] if isinstance(config[1], tuple) else (config[1],)
        self.threads[key] = max(self.threads.get(key, 0), int(np.prod(block)))
        order = self.seen.setdefault(key, len(self.seen))
        if key in self.results or order % self.shard[1] != self.shard[0]:
            return
        try:
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=self.cc)
            self.results[key] = (ptx, None)
        except Exception as exc:  # report every kernel, not just the first failure
            self.results[key] = (None, f"{type(exc).__name__}: {exc}")
        if self.dump_dir and self.results[key][0]:
            name = re.sub(r"\W+", "_", f"{key[0]}_{len(self.results)}")
            with open(os.path.join(self.dump_dir, name + ".ptx"), "w") as f:
                f.write(f"// {signature}\n{ptx}")


def exercise(rng) -> None:
    """Every launch wrapper at the compile-time specialisations a Qwen3-30B-A3B stage uses
    (head_dim 128, 8 query heads per kv head, 128 experts, 1..8 tokens per pass), small sizes."""
    from moebus.cuda.kernels import (attention, attention_decode, elementwise, embedding, linear, moe, moe_ffn,
                                     rmsnorm, rope, sampling)
    from moebus.cuda.dtypes import f32_to_bf16

    def f32(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def empty(*shape, dtype=np.float32):
        return np.empty(shape, dtype)

    for storage in (lambda a: f32_to_bf16(a), lambda a: a.astype(np.float16), lambda a: a):
        for tokens in (1, 2, 8, 9):
            linear.linear_cuda(f32(tokens, 64), storage(f32(24, 64)), empty(tokens, 24))
        linear.linear_cuda(f32(2, 13), storage(f32(5, 13)), empty(2, 5))  # narrow reads
        embedding.embedding_cuda(storage(f32(10, 16)), np.array([1, 2], np.int32), empty(2, 16))
        rmsnorm.rmsnorm_cuda(f32(3, 128), storage(f32(128)), 1e-6, empty(3, 128))
        rmsnorm.rmsnorm_cuda(f32(1, 2048), storage(f32(2048)), 1e-6, empty(1, 2048))  # a block per row
        arena = storage(f32(4, 3 * 32 * 64))
        for tokens in (1, 8):
            pairs = np.arange(tokens * 2, dtype=np.int32)
            moe_ffn.expert_ffn_cuda(f32(tokens, 64), pairs // 2, pairs % 4, pairs, arena, 64, 32,
                                    empty(tokens * 2, 64), empty(tokens * 2, 32))
        moe_ffn.expert_ffn_cuda(f32(1, 13), np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
                                storage(f32(2, 3 * 13 * 6)), 13, 6, empty(1, 13), empty(1, 6))
    # A3B decode widths: split rows (a router's 32 rows of 2048), the experts' unrolled rounds; then
    # the work shapes that sit behind constants (tools/device/decode_variants.py times them)
    big_arena = np.zeros((2, 3 * 768 * 2048), np.uint16)
    defaults = (linear.ROWS_PER_WARP, linear.MAX_UNROLL, moe_ffn.DOWN_ROWS_SHORT, moe_ffn.DOWN_ROWS_LONG,
                moe_ffn.GATE_UP_ROWS_SHORT)
    for shapes in (defaults, (4, 8, 2, 4, 2)):
        (linear.ROWS_PER_WARP, linear.MAX_UNROLL, moe_ffn.DOWN_ROWS_SHORT, moe_ffn.DOWN_ROWS_LONG,
         moe_ffn.GATE_UP_ROWS_SHORT) = shapes
        for tokens in (1, 8):
            linear.linear_cuda(f32(tokens, 2048), np.zeros((32, 2048), np.uint16), empty(tokens, 32))
            pairs = np.arange(tokens * 2, dtype=np.int32)
            moe_ffn.expert_ffn_cuda(f32(tokens, 2048), pairs // 2, pairs % 2, pairs, big_arena, 2048, 768,
                                    empty(tokens * 2, 2048), empty(tokens * 2, 768))
    (linear.ROWS_PER_WARP, linear.MAX_UNROLL, moe_ffn.DOWN_ROWS_SHORT, moe_ffn.DOWN_ROWS_LONG,
     moe_ffn.GATE_UP_ROWS_SHORT) = defaults
    from moebus.cuda.kernels import norm_route

    for tokens, experts, in_flight, spread in ((1, 32, True, False), (8, 128, True, False), (1, 32, False, False),
                                               (8, 128, False, False), (1, 32, True, True), (8, 32, True, True),
                                               (1, 32, True, "late")):
        norm_route.ROUTER_IN_FLIGHT = in_flight  # decode's MLP entry (norm + router + top-k + pairs), both kernels
        norm_route.ROUTER_EARLY = spread != "late"  # the router's first words before the wait (default) or after
        norm_route.norm_route_cuda(f32(tokens, 2048), f32(tokens, 2048), np.zeros(2048, np.uint16), 1e-6,
                                np.zeros((experts, 2048), np.uint16), 8, True, np.zeros((2, experts), np.int32), 1,
                                np.zeros(1, np.int32), empty(tokens, 2048), empty(tokens, 2048),
                                empty(tokens, 8, dtype=np.int32), empty(tokens, 8),
                                *(empty(tokens * 8, dtype=np.int32) for _ in range(3)),
                                scratch=empty(tokens, experts) if spread else None)  # the router over 8 blocks
    norm_route.ROUTER_IN_FLIGHT = True
    norm_route.ROUTER_EARLY = True
    for experts in (32, 128):  # the ROUTE entry's end of norm_route (linear_quant_mma.launch_route): ranks, argmaxes
        norm_route.route_tail_cuda(empty(2048 // 16, experts + 1), f32(1, 2048), np.zeros(2048, np.uint16), 1e-6, 8,
                                   True, np.zeros((2, experts), np.int32), 1, empty(1, 2048),
                                   empty(1, 8, dtype=np.int32), empty(1, 8), *(empty(8, dtype=np.int32) for _ in range(3)))
    elementwise.add_cuda(f32(2, 8), f32(2, 8), empty(2, 8))
    elementwise.swiglu_cuda(f32(2, 8), f32(2, 8), empty(2, 8))
    elementwise.fill_cuda(empty(4), 0)
    elementwise.fill_cuda(empty(4, dtype=np.int32), 0)
    cos, sin = rope.rope_tables(128, 1e6, 16)
    positions = np.array([3, 4], np.int32)
    rope.rope_cuda(f32(2, 32, 128), positions, cos, sin, empty(2, 32, 128))
    slots = np.array([0, 1], np.int32)
    for kv_dtype in (lambda a: f32_to_bf16(a), lambda a: a):  # bf16 and float32 KV caches
        k_cache, v_cache = kv_dtype(f32(2, 4, 16, 128)), kv_dtype(f32(2, 4, 16, 128))
        attention.kv_store_cuda(k_cache, v_cache, f32(2, 4, 128), f32(2, 4, 128), slots, positions)
        for done in (None, np.zeros(8, np.int32)):  # merge_splits apart, or by the split kernel's last block
            attention.attention_cuda(f32(2, 32, 128), k_cache, v_cache, slots, positions, 0.088, 0, empty(2, 32, 128),
                                     empty(*attention.attention_scratch_shape(2, 32, 128, 16)), done=done)
        decode_defaults = {k: getattr(attention_decode, k) for k in DECODE_SETTINGS[0]}
        for setting in DECODE_SETTINGS:  # the decode kernel's tunables (tools/device/decode14.sh times them)
            for key, value in setting.items():
                setattr(attention_decode, key, value)
            attention.attention_cuda(f32(2, 32, 128), k_cache, v_cache, slots, positions, 0.088, 0, empty(2, 32, 128),
                                     empty(*attention.attention_scratch_shape(2, 32, 128, 16)),
                                     done=np.zeros(8, np.int32))
            for key, value in decode_defaults.items():
                setattr(attention_decode, key, value)
        # a routed step's chunk beside a decode row (attention_chunk.py): A3B's group of 8 at hd 128,
        # and a group of 4 at hd 64
        from moebus.cuda.kernels import attention_chunk

        tiles = np.array([[0, 2, 0], [0, 0, 0]], np.int32)
        for heads, kv_heads, hd in ((32, 4, 128), (16, 4, 64)):
            # the numba kernels around the tensor-core one (an NVRTC cubin: test_attention_chunk_tc.py)
            max_rows = 64 // (heads // kv_heads)  # attention_chunk_tc.tile_rows
            attention_chunk.decode_positions[1, 256](tiles, max_rows, positions, empty(2, dtype=np.int32))
            attention_chunk.merge_tile_splits[1, 256](tiles, max_rows, positions, 256,
                                                      empty(*attention.attention_scratch_shape(2, heads, hd, 16)),
                                                      empty(2, heads, hd))
    moe.topk_softmax_cuda(f32(2, 128), 8, True, empty(2, 8, dtype=np.int32), empty(2, 8))
    moe.combine_cuda(f32(16, 64), f32(2, 8), empty(2, 64))
    from moebus.cuda.kernels import fused, routing

    for storage in (lambda a: f32_to_bf16(a), lambda a: a):
        fused.add_rmsnorm_cuda(f32(2, 2048), f32(2, 2048), storage(f32(2048)), 1e-6, empty(2, 2048), empty(2, 2048))
        fused.combine_add_rmsnorm_cuda(f32(16, 2048), f32(2, 8), f32(2, 2048), storage(f32(2048)), 1e-6,
                                       empty(2, 2048), empty(2, 2048))
        for kv_dtype in (lambda a: f32_to_bf16(a), lambda a: a):
            fused.qkv_rope_store_cuda(f32(2, 40 * 128), 32, 4, storage(f32(128)), storage(f32(128)), 1e-6, slots,
                                      positions, cos, sin, kv_dtype(k_cache), kv_dtype(v_cache), empty(2, 32, 128))

    routing.route_pairs_cuda(np.zeros((2, 8), np.int32), np.zeros((3, 128), np.int32), 1,
                             *(empty(16, dtype=np.int32) for _ in range(3)))
    from moebus.cuda.kernels import top_logprobs

    top_logprobs.top_logprobs_cuda(f32(2, 1000), 5, empty(2, 5, dtype=np.int32), empty(2, 5))
    from moebus.bench import kernels as bench_kernels

    bench_kernels._spin[1, 1, 0](10)
    rows = 2
    sampling.sample_cuda(f32(rows, 1000), np.ones(rows, np.float32), np.zeros(rows, np.int32),
                         np.ones(rows, np.float32), np.zeros(rows, np.float32), empty(rows, dtype=np.int32),
                         empty(rows), empty(rows, 1000))
    from moebus.cuda.kernels import penalties

    params = np.array([[0.5, 0.5, 1.2, 0.1]] * rows, np.float32)
    offsets, ids = np.array([0, 2, 3], np.int32), np.array([1, 5, 7], np.int32)
    penalties.apply_rules_cuda(f32(rows, 1000), np.ones(rows, np.float32), params, offsets, ids,
                               np.array([0, 2, -1], np.int32), f32(3), empty(rows, 1000))
    penalties.token_logprobs_cuda(f32(rows, 1000), np.array([1, 2], np.int32), empty(rows))
    exercise_vision(rng)
    exercise_quant(rng)
    exercise_tensor_cores(rng)


def exercise_quant(rng) -> None:
    """The quantized expert GEMVs (fp8, int4) at 1, 2 and 8 tokens."""
    from moebus.common.quant_layout import ExpertLayout
    from moebus.cuda.kernels import moe_quant, moe_quant_bf16

    for fmt, hardware in (("fp8", False), ("fp8", True), ("int4", False)):
        moe_quant.hardware_e4m3 = lambda chunk, hardware=hardware: hardware  # e4m3 by instruction or not
        for hidden in (64, 2048):  # 2048: whole rounds of words (A3B's rows), no clamped loads
            layout = ExpertLayout(fmt, hidden, 32)
            arena = np.zeros((4, layout.blob_bytes), np.uint8)
            for tokens in (1, 2, 8):
                pairs = np.arange(tokens * 2, dtype=np.int32)
                moe_quant.expert_ffn_quant_cuda(rng.standard_normal((tokens, hidden), dtype=np.float32), pairs // 2,
                                                pairs % 4, pairs, arena, layout,
                                                np.empty((tokens * 2, hidden), np.float32),
                                                np.empty((tokens * 2, 32), np.float32))
        layout = ExpertLayout(fmt, 64, 32)
        moe_quant_bf16.expert_weights_bf16_cuda(layout, np.zeros((4, layout.blob_bytes), np.uint8), np.zeros(2, np.int32),
                                                np.empty((2, 3 * 64 * 32), np.uint16))
    exercise_fp8_linear(rng)


def exercise_fp8_linear(rng) -> None:
    """The FP8 dense GEMV (attention.dtype fp8) at 1, 2 and 8 tokens, q/k/v's and o's row lengths."""
    from moebus.cuda.kernels import linear_quant

    for hardware in (False, True):
        linear_quant.hardware_e4m3 = lambda chunk, hardware=hardware: hardware
        for cols in (136, 2048, 4096):
            for tokens in (1, 2, 8):
                linear_quant.linear_fp8_cuda(rng.standard_normal((tokens, cols), dtype=np.float32),
                                             np.zeros((16, cols), np.uint8), np.zeros((16, -(-cols // 128)), np.float32),
                                             np.empty((tokens, 16), np.float32))
    linear_quant.fp8_to_bf16_cuda(np.zeros((16, 136), np.uint8), np.zeros((16, 2), np.float32),
                                  np.empty((16, 136), np.uint16))


def exercise_tensor_cores(rng) -> None:
    """The conversion, SwiGLU, softmax and gather kernels around the cuBLAS products of long steps."""
    from moebus.cuda.kernels import attention_parts, gemm, grouped_moe

    def f32(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def bits(*shape):
        return np.zeros(shape, np.uint16)

    gemm._no_rows = lambda: np.zeros(1, np.int32)  # a device array on the GPU; no driver here
    attention_parts._placeholder = lambda: np.zeros(3, np.uint16)
    gemm.split_rows_cuda(f32(9, 64), bits(2, 9, 64))
    gemm.split_rows_cuda(f32(9, 64), bits(2, 3, 64), rows=np.array([0, 4, 8], np.int32))
    gemm.add_bias_rows_cuda(f32(9, 64), bits(64))
    pair_row = np.zeros(6, np.int32)
    grouped_moe.plan_tiles_device[1, 64, 0](np.zeros((3, 2), np.int32), 4, 8, 2, np.zeros(4, np.int32), (0,) * 6,
                                           (1,) * 6, (0,) * 6, pair_row, np.zeros((6, 5), np.int64), np.zeros(5, np.int32))
    grouped_moe._launch(grouped_moe.gather_split_pairs, 6, 0, f32(3, 64), pair_row, 2, 2, 8, bits(64, 64))
    grouped_moe._launch(grouped_moe.swiglu_split_tiles, 8, 0, f32(64, 64), np.zeros(5, np.int32), 0, 1, 2, 8,
                        bits(64, 32))
    grouped_moe._launch(grouped_moe.sum_parts_pairs, 6, 0, f32(64, 64), pair_row, 2, 8, f32(6, 64))
    split = attention_parts.split_copies_cuda
    split(f32(9, 32, 128), False, 0, 0, attention_parts.Q3, 32, 9, bits(9 * 32 * 384))
    split(f32(9, 32, 128), False, 0, 0, attention_parts.Q2, 32, 9, bits(9 * 32 * 256))
    split(f32(4, 16, 128), True, 0, 0, attention_parts.K3, 4, 16, bits(4 * 16 * 384))
    split(bits(4, 16, 128), True, 0, 0, attention_parts.K3, 4, 16, bits(4 * 16 * 384))
    scores = f32(8 * 9 * 16)
    attention_parts.masked_softmax_cuda(scores, (8, 9, 16), 0, 0, True)
    attention_parts.masked_softmax_cuda(scores, (8, 9, 16), 0, 0, True, out=bits(8 * 9 * 48))
    attention_parts.masked_softmax_cuda(scores, (8, 9, 13), 0, 0, False, out=bits(8 * 9 * 48), pitch=16)  # an image's


def exercise_vision(rng) -> None:
    """The vision tower's kernels, at the specialisations SigLIP-so400m (head_dim 72), CLIP-L (64) and the
    largest head the attention tiles take (128) use."""
    from moebus.cuda.kernels import activations, layernorm, scatter, tiled_linear, vision_attention
    from moebus.cuda.dtypes import f32_to_bf16

    def f32(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    for storage in (lambda a: f32_to_bf16(a), lambda a: a.astype(np.float16), lambda a: a):
        layernorm.layernorm_cuda(f32(3, 64), storage(f32(64)), storage(f32(64)), 1e-6, f32(3, 64))
        activations.add_bias_cuda(f32(6, 8), storage(f32(8)), f32(6, 8))
        activations.add_bias_cuda(f32(6, 8), storage(f32(3, 8)), f32(6, 8))
        tiled_linear.tiled_linear_cuda(f32(70, 20), storage(f32(66, 20)), storage(f32(66)), f32(70, 66))
        tiled_linear.tiled_linear_cuda(f32(70, 20), storage(f32(66, 20)), None, f32(70, 66))
    for name in sorted(activations.DEVICE_FNS):
        activations.activation_cuda(f32(2, 8), name, f32(2, 8))
    for head_dim in (64, 72, 128):
        q = f32(2 * 5, 2, head_dim)
        vision_attention.vision_attention_cuda(q, q, q, 2, head_dim ** -0.5, f32(10, 2, head_dim))
    scatter.scatter_rows_cuda(f32(5, 8), np.array([0, 3], np.int32), f32(2, 8))
    exercise_qwen3vl_tower(rng)


def exercise_qwen3vl_tower(rng) -> None:
    """Qwen3-VL's tower: 2-D rotary (head_dim 72) with and without a bias, the bias epilogues, the
    epilogues that split the products' inputs."""
    from moebus.cuda.kernels import mrope, split_epilogues, tiled_linear
    from moebus.cuda.dtypes import f32_to_bf16

    def f32(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    cos, sin = mrope.vision_rope_tables(72, 10000.0, 8)
    positions = np.zeros((3, 2), np.int32)
    for bias in (None, f32_to_bf16(f32(2 * 72)), f32(2 * 72)):
        mrope.mrope_cuda(f32(3, 2, 72), positions, mrope.vision_axes(72), cos, sin, f32(3, 2, 72), bias=bias)
    for storage in (lambda a: f32_to_bf16(a), lambda a: a):
        tiled_linear.bias_residual_cuda(f32(3, 40), f32(3, 40), storage(f32(40)), f32(3, 40))
        for name in ("gelu", "gelu_pytorch_tanh"):
            tiled_linear.bias_activation_cuda(f32(3, 40), storage(f32(40)), name, f32(3, 40))
            for width in (40, 41):  # even: two elements' parts a 32-bit store; odd: one element at a time
                split_epilogues.bias_activation_split_cuda(f32(3, width), storage(f32(width)), name,
                                                           np.zeros((2, 3, width), np.uint16))
        split_epilogues.layernorm_split_cuda(f32(3, 64), storage(f32(64)), storage(f32(64)), 1e-6,
                                             np.zeros((2, 3, 64), np.uint16))


def _resources(ptxas: str, ptx: str, cc) -> tuple[int, int]:
    """(registers per thread, static shared bytes) that ptxas allocates for the kernel."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
    registers = re.search(r"Used (\d+) registers", run.stderr)
    shared = re.search(r"(\d+) bytes smem", run.stderr)
    return int(registers.group(1)) if registers else 0, int(shared.group(1)) if shared else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda-home", default=None)
    parser.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0 for H100/H200")
    parser.add_argument("--dump", default=None, help="write each kernel's PTX into this folder")
    parser.add_argument("--shard", default="0/1", help="I/N: check only the I-th of every N kernel variants "
                        "(N processes side by side cover them all)")
    args = parser.parse_args(argv)
    cuda_home = args.cuda_home or find_cuda_home()
    if cuda_home is None:
        print("no CUDA toolkit with NVVM and libdevice found (set CUDA_HOME)")
        return 2
    cc = tuple(int(p) for p in args.cc.split("."))
    dispatcher_class = _offline_numba(cuda_home, cc)
    shard = tuple(int(p) for p in args.shard.split("/"))
    if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
        parser.error(f"--shard wants I/N with 0 <= I < N, got {args.shard!r}")
    compiler = Compiler(cc, args.dump, shard)
    dispatcher_class.__getitem__ = lambda kernel, config: (lambda *a: compiler.launch(kernel, config, a))
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    exercise(np.random.default_rng(0))
    ptxas = os.path.join(cuda_home, "bin", "ptxas")
    failures = 0
    for key, (ptx, error) in sorted(compiler.results.items()):
        name, signature, _ = key
        if error:
            failures += 1
            print(f"FAIL {name}{signature}\n     {error.splitlines()[0][:300]}")
            continue
        f64, local = len(F64_OP.findall(ptx)), len(LOCAL_OP.findall(ptx))
        registers, shared = _resources(ptxas, ptx, cc) if os.path.exists(ptxas) else (0, 0)
        too_big = registers * compiler.threads[key] > REGISTERS_PER_SM or shared > MAX_STATIC_SHARED
        failures += bool(f64) or too_big
        flag = "F64 " if f64 else "SIZE" if too_big else "LOCAL" if local else "ok  "
        print(f"{flag} {name:<40} f64 {f64:2d} local {local:2d} regs {registers:3d} x {compiler.threads[key]:4d} "
              f"smem {shared:5d}  {signature}")
    print(f"{len(compiler.results)} kernel variants (shard {args.shard} of {len(compiler.seen)}), {failures} with problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
