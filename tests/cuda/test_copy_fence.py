"""The expert cache's chained prefill copies on the real StreamCopier over a device arena (numba's
simulator, or a GPU with MOEBUS_TEST_GPU=1: there each copy is one cuMemcpyHtoDAsync, runs of
consecutive slots and keys one copy): after passes larger than the cache every slot holds its key's
blob, and each layer's copies waited for a fence of the compute stream, not for all of it."""
import numpy as np
import pytest

from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.memory.vmm import DeviceArena, Fence, StreamCopier
from moebus.workers.expert_cache import ExpertCache

LAYERS, EXPERTS, ELEMS = 5, 4, 64


class Store:
    num_experts = EXPERTS
    blob_bytes = ELEMS * 2
    layers = list(range(LAYERS))
    row_of_layer = {layer: layer for layer in range(LAYERS)}

    def __init__(self):
        self.blobs = np.arange(LAYERS * EXPERTS * ELEMS, dtype=np.uint16).reshape(-1, ELEMS)

    def key(self, layer, expert):
        return layer * EXPERTS + int(expert)

    def blob(self, key):
        return self.blobs[key]


class Backend:
    def __init__(self):
        from numba import cuda

        self.stream = cuda.stream()


@pytest.mark.parametrize("mode", ["slot", "all"])
def test_chained_copies_land_in_their_slots(mode):
    arena = DeviceArena(ELEMS * 2, np.uint16, [ELEMS * 2 * 12])
    arena.grow()
    copier = StreamCopier(arena, Backend())
    waited = []
    copy = copier.copy
    copier.copy = lambda slot, blob, after=None: waited.append(after) or copy(slot, blob, after)
    cache = ExpertCache(Store(), arena, copier, policy="freq", min_slots=EXPERTS)
    cache.copy_fence = mode
    cache.timeline = []
    for _ in range(2):  # two passes of 20 experts through 12 slots
        for layer in range(LAYERS):
            cache.acquire(layer, range(EXPERTS))
            cache.wait()
            cache.release()
        cache.release()
    copier.sync()
    copier.compute_stream.synchronize()
    assert copier.driver_copies == (not SIMULATOR)
    for key, slot in cache.key_slot.items():
        assert (arena.read(slot) == cache.store.blob(key)).all()
    if mode == "slot":
        assert waited and all(isinstance(after, Fence) for after in waited)
        assert len(cache.timeline) == 2 * LAYERS and all("copy_start" in t for t in cache.timeline if t["misses"])
    else:
        assert waited and all(after is None for after in waited)
