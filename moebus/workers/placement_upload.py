"""The expert cache's placement table, uploaded in stream order from pinned buffers of its own.

``ops.overwrite`` stages through the backend's step pool, which only ``begin_step`` recycles; a chain
of steps launched ahead (workers/overlap.py) never calls it, and with a cache that evicts the table
changes almost every step: one new pinned buffer a step (a cuMemHostAlloc on the host's path, and
memory that is never given back over a long decode). Here a few buffers are taken in turn, each
reused once the copy out of it is complete (an event recorded after it). On the cpu backend, or the
simulator, ``ops.overwrite`` is used as it is (it copies at once)."""
from __future__ import annotations

import numpy as np

DEPTH = 4  # uploads in flight at most before one waits: a launched-ahead chain has ~3 (two steps' and an admission's)


class PlacementUploads:
    def __init__(self, ops, depth: int = DEPTH):
        from moebus.cuda.kernels.compat import SIMULATOR, cuda

        self.ops = ops
        self.ring = None  # [pinned host buffer, event after the copy out of it (None: not used yet)]
        if not SIMULATOR and hasattr(ops, "stream") and hasattr(ops, "staging_pool"):
            self.cuda, self.depth, self.ring, self.next = cuda, depth, [], 0

    def overwrite(self, target, host: np.ndarray) -> None:
        """Copy ``host`` into the device array ``target`` in stream order; ``host`` may change at once."""
        if self.ring is None:
            self.ops.overwrite(target, host)
            return
        host = np.ascontiguousarray(host)
        if len(self.ring) < self.depth:
            self.ring.append([self.cuda.pinned_array(host.shape, host.dtype), None])
        entry = self.ring[self.next]
        self.next = (self.next + 1) % self.depth
        staged, done = entry
        assert staged.shape == host.shape and staged.dtype == host.dtype, "the table's shape is fixed at load"
        if done is None:
            done = entry[1] = self.cuda.event(timing=False)
        else:
            done.synchronize()  # the copy out of it, DEPTH uploads ago (long complete in a steady loop)
        staged[...] = host
        target.copy_to_device(staged, stream=self.ops.stream)
        done.record(self.ops.stream)
