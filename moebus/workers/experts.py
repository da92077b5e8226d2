"""Build a stage's expert cache for its device: host store, arena, copier and, on cuda where the
cache cannot hold every expert, the prefetch's banks. Without a capacity, the arena holds every
expert of the stage (no eviction ever happens)."""
from __future__ import annotations

from moebus.cuda.memory.arena import HostArena, plan_segments, segment_bytes_for
from moebus.workers.expert_cache import ExpertCache
from moebus.workers.host_store import HostStore
from moebus.workers.prefetch import BANKS, DEFAULT_SLOTS_PER_LAYER, PREDICTED_PER_TOKEN, Prefetch

DEFAULT_SEGMENT_BYTES = 2 << 20


def build_expert_cache(ckpt, layers: range, backend, capacity_bytes: int | None = None,
                       segment_bytes: int = DEFAULT_SEGMENT_BYTES, elastic: bool = False, gpu=None,
                       startup_reserve_mib: float = 0.0, progress=iter, fraction: float | None = None,
                       policy: str = "freq", preload: bool = True, store: HostStore | None = None,
                       experts_dtype: str = "bf16", prefetch_slots: int = DEFAULT_SLOTS_PER_LAYER) -> ExpertCache:
    """``capacity_bytes``: the arena's start-up size (None: room for every expert of the stage);
    ``fraction``: instead, that share of the stage's experts (tests and benchmarks).
    ``gpu``: the emulated GPU's ledger on cpu. ``elastic``: segments of ``segment_bytes`` that VRAM
    requests can release (else one segment; 0: two slots a segment, ``segment_bytes_for``).
    ``policy``: eviction.POLICIES. ``preload``: fill the cache before serving (every layer its share),
    so the first steps do not run at PCIe speed.
    ``store``: the stage's host store when one is built already (a second cache over the same experts).
    ``experts_dtype``: bf16, fp8 or int4 (settings ``experts.dtype``): the blobs the store pins and a
    slot holds, so the same capacity holds ~2x (fp8) or ~3.5x (int4) the experts. ``prefetch_slots``:
    the next layer's experts copied ahead at most, per layer (settings ``experts.prefetch_slots``; 0:
    no prefetch); two banks of them come out of the cache."""
    on_cuda = backend.name == "cuda"
    store = store or HostStore(ckpt, layers, allocate=backend.host_empty if on_cuda else _np_empty, progress=progress,
                               device_view=backend.host_device_view if on_cuda else None, experts_dtype=experts_dtype)
    if fraction is not None:
        capacity_bytes = int(store.total_bytes * fraction)
    total = min(capacity_bytes, store.total_bytes) if capacity_bytes is not None else store.total_bytes
    total = max(total, store.blob_bytes * ckpt.config.top_k)
    if elastic:
        segments = plan_segments(_round_up(total), segment_bytes_for(segment_bytes, store.blob_bytes))
    else:  # one segment; VRAM is mapped in 2 MiB granules, host memory need not be
        segments = [_round_up(total) if on_cuda else total]
    if on_cuda:
        from moebus.cuda.memory.vmm import StreamCopier, make_device_arena

        arena = make_device_arena(store.blob_bytes, store.dtype, segments, elastic)
        copier = StreamCopier(arena, backend)
    else:
        arena = HostArena(store.blob_bytes, store.dtype, segments, gpu=gpu)
        copier = None
    arena.grow()
    cfg = ckpt.config
    prefetch = None
    if on_cuda and prefetch_slots and store.layers and BANKS * prefetch_slots * 2 + cfg.top_k <= arena.num_slots \
            < store.num_blobs:  # room for the banks and more than them for the cache; and misses to prefetch
        prefetch = Prefetch(prefetch_slots, len(store.layers), store.num_experts, min(cfg.top_k, PREDICTED_PER_TOKEN),
                            store.blob_bytes)
    reserved = prefetch.num_reserved if prefetch is not None else 0
    cache = ExpertCache(store, arena, copier, policy=policy, startup_reserve_mib=startup_reserve_mib,
                        min_slots=cfg.top_k + reserved, prefetch=prefetch)
    if preload:
        cache.preload()
    return cache


def _round_up(num_bytes: int, granule: int = 2 << 20) -> int:
    return -(-num_bytes // granule) * granule


def _np_empty(shape, dtype):
    import numpy as np

    return np.empty(shape, dtype)
