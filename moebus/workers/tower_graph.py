"""A vision tower's encode as one CUDA graph (cuda/backends/graphs.py's CapturedStep): an encode is
hundreds of launches (~30 us each from Python) over a few ms of GPU work, so on cuda the encode of
the last input shape is captured once and replayed (one input copy, one launch, the outputs copied
back into pinned memory). A new shape replaces the graph (its scratch goes with it), so a tower
holds one encode's scratch as before. Elsewhere (cpu, the simulator, MOEBUS_CUDA_GRAPHS=0, a
capture that fails) the same ``forward`` runs eagerly.

``forward(inputs)`` takes the device inputs by name and returns the device outputs by name; it
must only enqueue work (no host copy, no sync; graphs.py), and the same shapes must take the same
path."""
from __future__ import annotations

import logging
import os

import numpy as np

from moebus.cuda.backends import is_fatal_device_error, is_out_of_memory

log = logging.getLogger("moebus.vision")


class TowerGraph:
    def __init__(self, backend):
        from moebus.cuda.backends.graphs import graphs_available

        self.ops = backend
        self.enabled = backend.name == "cuda" and graphs_available() and os.environ.get("MOEBUS_CUDA_GRAPHS", "1") != "0"
        self.key = None
        self.graph = None

    def run(self, key, host_inputs: dict[str, np.ndarray], forward) -> dict[str, np.ndarray]:
        """Host copies of ``forward``'s outputs for these inputs; ``key`` names what else the
        captured work depends on (buffers sized by it), so a new key captures anew."""
        graph = self._graph_for(key, host_inputs, forward) if self.enabled else None
        if graph is not None:
            return graph.replay(host_inputs)
        ops = self.ops
        ops.begin_step()
        outputs = forward({name: ops.upload(array) for name, array in host_inputs.items()})
        return {name: ops.to_host(array) for name, array in outputs.items()}

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
