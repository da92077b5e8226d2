"""Quantized expert blobs (fp8 / int4, common/quant_layout.py) as bf16 blobs gate | up | down, what
a bf16 arena slot holds: the hook through which a multi-token path built for bf16 experts (a grouped
GEMM) takes quantized ones, dequantizing the step's active experts into bf16 scratch. The numpy
reference and the device kernel (one thread per output element) round to nearest even alike.

Shapes: N experts, D hidden, I expert intermediate, B blob bytes."""
from __future__ import annotations

import functools

import numpy as np

from moebus.common.quant import BLOCK
from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels.compat import SIMULATOR, blocks, cuda, device, float32, kernel, threads, uint32, uint64
from moebus.cuda.kernels.pdl import grid_dependency_wait
from moebus.cuda.kernels.launch import ceil_div, require
from moebus.cuda.kernels.quant_words import e4m3_at
from numba import uint16  # noqa: E402 (compat configured numba above)


def expert_weights_bf16(layout: ExpertLayout | None, blobs: np.ndarray) -> np.ndarray:
    """The multi-token path's hook: blobs (N, B) of this layout as bf16 blobs (N, 3 I D) laid out
    gate | up | down, what a bf16 arena slot holds (None: the blobs already are)."""
    if layout is None:
        return blobs
    out = np.empty((len(blobs), 3 * layout.inter * layout.hidden), np.uint16)
    for row, blob in zip(out, blobs):
        row[:] = np.concatenate([f32_to_bf16(w).reshape(-1) for w in layout.dequantize(np.asarray(blob))])
    return out

if SIMULATOR:
    def _f32_bits(value):
        return int(np.float32(value).view(np.uint32))
else:
    @device
    def _f32_bits(value):
        return uint32(cuda.libdevice.float_as_int(value))


@device
def _bf16_bits(value):
    """Round to nearest even, as cuda/dtypes.f32_to_bf16."""
    u = _f32_bits(value)
    return uint16((u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16))


@functools.cache
def _to_bf16_kernel(fmt: str):
    is_fp8 = fmt == "fp8"

    @kernel
    def blobs_to_bf16(codes, floats, slots, hidden, inter, gate_at, up_at, down_at, gate_scale, up_scale,
                      down_scale, out):
        # codes: the blobs as uint8, floats: the same bytes as float32 (byte offsets: *_at, *_scale);
        # out (N, 3 I D) uint16
        grid_dependency_wait()  # pdl.py: before any global read or write
        per_matrix = hidden * inter
        per_expert = 3 * per_matrix
        for n in range(cuda.grid(1), slots.shape[0] * per_expert, cuda.gridsize(1)):
            e = n // per_expert
            k = n % per_expert
            m = k // per_matrix
            cols = hidden if m < 2 else inter
            r = (k % per_matrix) // cols
            c = (k % per_matrix) % cols
            slot = slots[e]
            code_at = gate_at if m == 0 else (up_at if m == 1 else down_at)
            scale_at = (gate_scale if m == 0 else (up_scale if m == 1 else down_scale)) // 4
            if is_fp8:
                value = e4m3_at(uint32(codes[slot, code_at + r * cols + c]), 0) * \
                    floats[slot, scale_at + (r // BLOCK) * ((cols + BLOCK - 1) // BLOCK) + c // BLOCK]
            else:
                nibble = (codes[slot, code_at + (r * cols + c) // 2] >> (4 * (c % 2))) & 15
                p = scale_at + 2 * (r * ((cols + BLOCK - 1) // BLOCK) + c // BLOCK)
                value = float32(nibble) * floats[slot, p] + floats[slot, p + 1]
            out[e, k] = _bf16_bits(value)

    return blobs_to_bf16


def expert_weights_bf16_cuda(layout: ExpertLayout, arena, slots, out, stream=0):
    """expert_weights_bf16 on device arrays: the experts in ``slots`` (int32) of ``arena`` (uint8
    blobs of ``layout``) as bf16 blobs in ``out`` (len(slots), 3 I D) uint16, e.g. scratch slots
    that a bf16 grouped GEMM reads."""
    require("arena", arena, np.uint8, shape=(None, layout.blob_bytes))
    require("slots", slots, np.int32, ndim=1)
    require("out", out, np.uint16, shape=(slots.shape[0], 3 * layout.hidden * layout.inter))
    if slots.shape[0] == 0:
        return out
    offsets = [x.code_offset for x in layout.matrices] + [x.scale_offset for x in layout.matrices]
    grid = blocks(ceil_div(out.size, 256))
    _to_bf16_kernel(layout.dtype)[grid, threads(256), stream](arena, arena.view(np.float32), slots, layout.hidden,
                                                             layout.inter, *offsets, out)
    return out
