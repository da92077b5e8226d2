"""How a tower's encode results reach the host (workers/tower_graph.py): a replay's pinned outputs
read one at a time as the graph makes them (``ReadyOutputs``, tower_graph.COLLECT_BESIDE: a one-thread
kernel raises a word of mapped host memory after each early output's copy), and Qwen3-VL's collect,
which copies the embeddings and the DeepStack features into one (1 + L, N, D) array — what its
ENCODE_REPLY carries and the broker keeps as it is (broker/vision_qwen3vl.py)."""
from __future__ import annotations

import functools
import time

import numpy as np

MAX_FLAGS = 16  # early outputs a graph may flag


class ReadyOutputs(dict):
    """A replay's pinned outputs by name, before the graph has ended: ``ready(name)`` waits until that
    one is copied (a flagged early output: its flag; any other: the whole graph); ``collect`` must
    call it before it reads an output (``_copies`` and Qwen3-VL's collect do)."""

    def __init__(self, graph):
        super().__init__(graph.host_outputs)
        self.graph, self.ended = graph, False

    def ready(self, name: str) -> None:
        index = self.graph.flag_of.get(name)
        if index is None:
            self.finish()
            return
        flags, spins = self.graph.flags, 0
        while not flags[index] and not self.ended:
            spins += 1
            if spins % 64 == 0 and _stream_done(self.graph.backend.stream):  # (a flag that never came)
                self.ended = True
            time.sleep(0)

    def finish(self) -> None:
        if not self.ended:
            self.graph.backend.stream.synchronize()
            self.ended = True


def _stream_done(stream) -> bool:
    from cuda.bindings import driver as cu

    (status,) = cu.cuStreamQuery(int(stream.__cuda_stream__()[1]))
    return status != cu.CUresult.CUDA_ERROR_NOT_READY


def ready(outputs, name: str) -> None:
    """Wait until ``outputs[name]`` may be read (ReadyOutputs); at once for a plain dict."""
    if isinstance(outputs, ReadyOutputs):
        outputs.ready(name)


@functools.cache
def raise_flag_kernel():
    """flags[index] = 1: launched on the stream after a copy, so the copy has ended when the host sees it
    (the copy's DMA completes before the stream's next work starts)."""
    from moebus.cuda.kernels.compat import kernel

    @kernel
    def raise_flag(flags, index):
        flags[index] = 1

    return raise_flag


def stacked_outputs(out: dict) -> np.ndarray:
    """(1 + L, N, D): the embeds, then the DeepStack features, copied out of ``out`` (tower_graph.py's
    host outputs, perhaps its pinned buffers) into one array: one copy of each, in slices at once
    (copy_pairs), each feature as soon as it is ready (tower_graph.ready: perhaps while the last
    blocks still run). What ENCODE_REPLY carries as it is, and the broker keeps (vision_qwen3vl.py)."""
    from moebus.workers.tower_graph import copy_pairs  # (it imports this module)

    features = [f"deepstack{j}" for j in range(len(out) - 1)]
    stacked = np.empty((1 + len(features),) + out["embeds"].shape, out["embeds"].dtype)
    pairs = [(stacked[1 + j], name) for j, name in enumerate(features)] + [(stacked[0], "embeds")]
    if not isinstance(out, ReadyOutputs):  # all there: one copy_pairs
        copy_pairs([(dst, out[name]) for dst, name in pairs])
        return stacked
    touch_pages(stacked[0])  # (while the graph runs: what is copied last then meets no page faults)
    for dst, name in pairs:
        ready(out, name)
        copy_pairs([(dst, out[name])])
    return stacked


def touch_pages(array: np.ndarray, page_bytes: int = 4096) -> None:
    """Write one element a page of a fresh (C-contiguous) array, so that its pages are mapped before
    a copy into it (the kernel zeroes each page at its first write: ~0.3 ms for the 6.3 MB of a
    1024 x 768 image's embeddings, otherwise after the graph's last kernel)."""
    flat = array.reshape(-1)
    flat[::max(page_bytes // flat.itemsize, 1)] = 0


def embeds_and_deepstack(out: dict) -> tuple[np.ndarray, np.ndarray]:
    """(embeds (N, D), DeepStack features (L, N, D)): views of one stacked_outputs array."""
    stacked = stacked_outputs(out)
    return stacked[0], stacked[1:]


def views_of_one(embeds: np.ndarray, deepstack: np.ndarray) -> bool:
    """Are (embeds, deepstack) embeds_and_deepstack's views of one whole (1 + L, N, D) array?"""
    base = embeds.base
    return base is not None and deepstack.base is base and base.shape == (1 + deepstack.shape[0],) + embeds.shape \
        and base.flags.c_contiguous and embeds.ctypes.data == base.ctypes.data
