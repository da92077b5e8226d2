"""A vision tower's encode as one CUDA graph (cuda/backends/graphs.py's CapturedStep): an encode is
hundreds of launches (~30 us each from Python) over a few ms of GPU work, so on cuda the encode of
the last input shape is captured once and replayed (one input copy, one launch, the outputs copied
back into pinned memory). A new shape replaces the graph (its scratch goes with it), so a tower
holds one encode's scratch as before. The encode that makes a graph returns the results of the
eager run that the capture starts with (graphs.py), so a new shape costs one pass on the GPU, not
two (Qwen3-VL's images come in many sizes). Elsewhere (cpu, the simulator, MOEBUS_CUDA_GRAPHS=0, a
capture that fails) the same ``forward`` runs eagerly.

``forward(inputs)`` takes the device inputs by name and returns the device outputs by name; it
must only enqueue work (no host copy, no sync; graphs.py), and the same shapes must take the same
path. ``collect(outputs)`` makes the caller's host results out of the host outputs by name, which
may be the graph's pinned buffers (overwritten by the next encode): it must copy what it keeps, and
so the outputs are copied once (the default: a copy of each; Qwen3-VL stacks its DeepStack features
in the same copy). The host copies of a replay (the inputs into the pinned staging, the outputs out
of the pinned buffers: ~44 MB for a 1024 x 768 image on Qwen3-VL) run in COPY_THREADS slices at once
(``copy_pairs``: numpy lets the GIL go while it copies)."""
from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from moebus.cuda.backends import is_fatal_device_error, is_out_of_memory

log = logging.getLogger("moebus.vision")
COPY_THREADS = int(os.environ.get("MOEBUS_TOWER_COPY_THREADS", "4"))  # 1: plain numpy copies
COPY_SLICE_BYTES = 2 << 20  # copies are cut into slices of this size, COPY_THREADS at a time


class TowerGraph:
    def __init__(self, backend):
        from moebus.cuda.backends.graphs import graphs_available

        self.ops = backend
        self.enabled = backend.name == "cuda" and graphs_available() and os.environ.get("MOEBUS_CUDA_GRAPHS", "1") != "0"
        self.key = None
        self.graph = None

    def run(self, key, host_inputs: dict[str, np.ndarray], forward, collect=None):
        """``collect`` (default: copies by name) of ``forward``'s outputs for these inputs; ``key``
        names what else the captured work depends on (buffers sized by it), so a new key captures anew."""
        collect = collect or _copies
        runs = []  # forward's outputs when a new graph is made: its eager run's, then the capture's
        graph = self._graph_for(key, host_inputs, lambda inputs: _kept(runs, forward(inputs))) if self.enabled else None
        if graph is not None:
            if not (len(runs) == 2 and _same_buffers(*runs)):  # else the eager run's results are in the outputs
                upload(graph, host_inputs)
                graph.graph.launch(graph.stream)
            return collect(pinned_out(graph))
        ops = self.ops
        ops.begin_step()
        outputs = forward({name: ops.upload(array) for name, array in host_inputs.items()})
        return collect({name: ops.to_host(array) for name, array in outputs.items()})

    def _graph_for(self, key, host_inputs: dict, forward):
        if self.graph is not None and self.key == key and self.graph.matches(host_inputs):
            return self.graph
        from moebus.cuda.backends.graphs import CapturedStep

        self.close()  # the old graph's scratch goes before the new one's comes
        try:
            self.graph, self.key = CapturedStep(self.ops, host_inputs, forward), key
        except Exception as e:  # noqa: BLE001 - a driver or binding that cannot capture: encode eagerly
            if is_fatal_device_error(e) or is_out_of_memory(e):
                raise
            log.warning("CUDA graph capture of the vision tower failed (%s: %s); it encodes eagerly",
                        type(e).__name__, e)
            self.enabled = False
        return self.graph

    def close(self) -> None:
        """Drop the captured graph (before buffers it reads are replaced, or to free its scratch)."""
        if self.graph is not None:
            self.graph.close()
        self.graph, self.key = None, None


def _kept(runs: list, outputs: dict) -> dict:
    runs.append(outputs)
    return outputs


def _same_buffers(eager: dict, captured: dict) -> bool:
    """A new graph ran ``forward`` once eagerly (to fill its pool) and then captured it without
    running it: the same takes in the same order got the same buffers (step_pool.py), so the
    captured outputs hold the eager run's results and the encode need not replay the graph."""
    from moebus.cuda.kernels.gemm import address

    return eager.keys() == captured.keys() and all(address(eager[n]) == address(captured[n]) for n in eager)


def upload(graph, host_inputs: dict) -> None:
    """CapturedStep's upload with the host copies into its pinned staging in slices at once."""
    copy_pairs([(graph.host_views[name], host_inputs[name]) for name in graph.host_views])
    graph.packed.copy_to_device(graph.staging, stream=graph.backend.stream)


def pinned_out(graph) -> dict[str, np.ndarray]:
    """The outputs copied into the graph's pinned buffers (as CapturedStep.replay, less its copies)."""
    stream = graph.backend.stream
    for name, array in graph.outputs.items():
        array.copy_to_host(graph.host_outputs[name], stream=stream)
    stream.synchronize()
    return graph.host_outputs


def copy_pairs(pairs) -> None:
    """dst[...] = src for each (dst, src) pair of equal shapes; contiguous pairs of one dtype go in
    slices of COPY_SLICE_BYTES, COPY_THREADS at a time (a fresh dst's page faults too)."""
    slices = []
    for dst, src in pairs:
        src = np.asarray(src)
        if dst.shape != src.shape:
            raise ValueError(f"copy of {src.shape} into {dst.shape}")
        if COPY_THREADS <= 1 or dst.dtype != src.dtype or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            dst[...] = src
            continue
        flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
        step = max(COPY_SLICE_BYTES // max(dst.itemsize, 1), 1)
        slices += [(flat_dst[i:i + step], flat_src[i:i + step]) for i in range(0, flat_dst.size, step)]
    if len(slices) > 1:
        list(_copy_pool().map(_copy_slice, slices))
    elif slices:
        _copy_slice(slices[0])


def copied(array) -> np.ndarray:
    """A fresh copy of ``array`` (copy_pairs)."""
    out = np.empty(array.shape, array.dtype)
    copy_pairs([(out, array)])
    return out


def _copy_slice(pair) -> None:
    pair[0][...] = pair[1]


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="tower-copy")


def _copies(outputs: dict) -> dict[str, np.ndarray]:
    return {name: copied(out) for name, out in outputs.items()}
