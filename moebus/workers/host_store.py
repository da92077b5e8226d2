"""Every expert of a stage packed once as one blob (gate | up | down) in host memory: pinned
(page-locked) and mapped into the device's address space on cuda, so copies to VRAM run at full
PCIe speed and kernels can read a missing expert in place (zero copy); plain on cpu. Filled from
the memory-mapped checkpoint, expert by expert, with a progress bar.

The blobs are in the experts' dtype: the checkpoint's own (bf16), or quantized at load to fp8 or
int4 (common/quant_layout.py: one uint8 blob of codes and scales). An FP8 checkpoint's experts keep
their own codes and scales under fp8 and are dequantized for bf16 or int4."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from moebus.common.fp8_checkpoint import expert_fp8
from moebus.common.quant import fp8_dequantize
from moebus.common.quant_layout import expert_layout
from moebus.cuda.dtypes import STORAGE, f32_to_bf16, to_f32

FILL_THREADS = min(8, os.cpu_count() or 1)


class HostStore:
    def __init__(self, ckpt, layers: range, allocate=np.empty, progress=iter, device_view=None,
                 experts_dtype: str = "bf16"):
        """``allocate(shape, dtype)``: the blobs' memory; ``device_view(blobs)``: the same memory as
        the kernels take it (None: the array itself, as on cpu); ``experts_dtype``: bf16 (as stored;
        an FP8 checkpoint's experts dequantized to bf16), fp8 or int4."""
        cfg = ckpt.config
        self.num_experts = cfg.num_experts
        self.layers = [i for i in layers if cfg.is_moe_layer(i)]
        self.row_of_layer = {layer: n for n, layer in enumerate(self.layers)}
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.experts_dtype = experts_dtype
        self.layout = expert_layout(experts_dtype, d, inter)  # None: bf16 blobs, gate | up | down
        self.dtype = STORAGE[ckpt.weight_dtype] if self.layout is None else np.dtype(np.uint8)
        self.blob_elems = 3 * inter * d if self.layout is None else self.layout.blob_bytes
        self.blob_bytes = self.blob_elems * self.dtype.itemsize
        memory = allocate((len(self.layers) * self.num_experts, self.blob_elems), self.dtype)
        self.device_blobs = memory if device_view is None else device_view(memory)
        self.blobs = np.asarray(memory).view(np.ndarray)  # host side: plain numpy over the same bytes
        # a layer's experts side by side: quantizing is numpy work that releases the GIL (~50 ms an A3B
        # expert on one core, so a 48 x 128 model's fp8 load took minutes expert after expert)
        with ThreadPoolExecutor(FILL_THREADS) as pool:
            for layer in progress(self.layers):
                base = self.row_of_layer[layer] * self.num_experts
                list(pool.map(lambda e, layer=layer, base=base: self._fill(self.blobs[base + e], ckpt, layer, e),
                              range(self.num_experts)))

    def _fill(self, row: np.ndarray, ckpt, layer: int, expert: int) -> None:
        stored_fp8 = expert_fp8(ckpt, layer, expert) if ckpt.quantization is not None else None
        if self.layout is not None and self.layout.dtype == "fp8" and stored_fp8 is not None:
            self.layout.pack(stored_fp8, out=row)  # the checkpoint's own scales
            return
        if stored_fp8 is not None:
            matrices = [fp8_dequantize(codes, scale) for codes, scale in stored_fp8]
        else:
            matrices = ckpt.expert(layer, expert)
        if self.layout is not None:
            self.layout.quantize(*(to_f32(w) for w in matrices), out=row)
            return
        n = matrices[0].size
        for i, w in enumerate(matrices):
            row[i * n : (i + 1) * n] = (f32_to_bf16(w) if stored_fp8 is not None else w).reshape(-1)

    @property
    def num_blobs(self) -> int:
        return len(self.blobs)

    @property
    def total_bytes(self) -> int:
        return self.num_blobs * self.blob_bytes

    def key(self, layer: int, expert: int) -> int:
        """The row of (layer, expert): also the cache's key for it."""
        return self.row_of_layer[layer] * self.num_experts + int(expert)

    def layer_of(self, key: int) -> int:
        return self.layers[key // self.num_experts]

    def blob(self, key: int) -> np.ndarray:
        return self.blobs[key]
