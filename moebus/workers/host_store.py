"""Every expert of a stage packed once as one blob (gate | up | down) in host memory: pinned
(page-locked) and mapped into the device's address space on cuda, so copies to VRAM run at full
PCIe speed and kernels can read a missing expert in place (zero copy); plain on cpu. Filled from
the memory-mapped checkpoint, expert by expert, with a progress bar."""
from __future__ import annotations

import numpy as np

from moebus.cuda.dtypes import STORAGE


class HostStore:
    def __init__(self, ckpt, layers: range, allocate=np.empty, progress=iter, device_view=None):
        """``allocate(shape, dtype)``: the blobs' memory; ``device_view(blobs)``: the same memory as
        the kernels take it (None: the array itself, as on cpu)."""
        cfg = ckpt.config
        self.num_experts = cfg.num_experts
        self.layers = [i for i in layers if cfg.is_moe_layer(i)]
        self.row_of_layer = {layer: n for n, layer in enumerate(self.layers)}
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.dtype = STORAGE[ckpt.weight_dtype]
        self.blob_elems = 3 * inter * d
        self.blob_bytes = self.blob_elems * self.dtype.itemsize
        memory = allocate((len(self.layers) * self.num_experts, self.blob_elems), self.dtype)
        self.device_blobs = memory if device_view is None else device_view(memory)
        self.blobs = np.asarray(memory).view(np.ndarray)  # host side: plain numpy over the same bytes
        n = inter * d
        for layer in progress(self.layers):
            base = self.row_of_layer[layer] * self.num_experts
            for e in range(self.num_experts):
                gate, up, down = ckpt.expert(layer, e)
                row = self.blobs[base + e]
                row[:n] = gate.reshape(-1)
                row[n : 2 * n] = up.reshape(-1)
                row[2 * n :] = down.reshape(-1)

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
