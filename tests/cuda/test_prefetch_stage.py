"""The prefetch in decode steps (numba's simulator, the micro model of test_e2e: 2 MoE layers of 4
experts, top-2): the next layer's predicted misses, copied into the bank slots on the side branch,
change where the experts are read from, never what comes out."""
import numpy as np

from moebus.common.checkpoint import Checkpoint
from moebus.cuda.backends import make_backend
from moebus.cuda.memory.vmm import DeviceArena
from moebus.workers.batch import StepBatch
from moebus.workers.expert_cache import ExpertCache
from moebus.workers.experts import build_expert_cache
from moebus.workers.host_store import HostStore
from moebus.workers.prefetch import Prefetch
from moebus.workers.stage import Stage
from tests.cuda.test_e2e import micro_model  # noqa: F401 - the fixture

PROMPT = [5, 17, 42]


def _stage(model_dir, num_slots: int = 6, slots_per_layer: int = 1, kv_slots: int = 2):
    """A stage over a cache of ``num_slots`` of the 8 experts, the first 2 of them the banks."""
    ckpt, backend = Checkpoint(model_dir), make_backend("cuda")
    store = HostStore(ckpt, range(2), allocate=backend.host_empty, device_view=backend.host_device_view)
    arena = DeviceArena(store.blob_bytes, store.dtype, [num_slots * store.blob_bytes])
    arena.grow()
    prefetch = Prefetch(slots_per_layer, 2, store.num_experts, ckpt.config.top_k, store.blob_bytes)
    cache = ExpertCache(store, arena, min_slots=ckpt.config.top_k + 2, prefetch=prefetch)
    cache.preload()
    return Stage(ckpt, range(2), backend, kv_slots, 32, experts=cache)


def _blas():
    """numpy over the simulator's host memory; cuBLAS on a GPU (HostBlas would read device addresses
    as host memory there: the segfault these tests ended the H200's pytest with, twenty-second to
    twenty-sixth sessions)."""
    from moebus.cuda.kernels.compat import SIMULATOR
    from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas

    return HostBlas() if SIMULATOR else cublas_blas()


def _decode(stage, slot: int, steps: int = 1, batch: int = 1):
    """Greedy steps of ``batch`` sequences of PROMPT on KV slots slot ... slot + batch - 1."""
    slots = list(range(slot, slot + batch))
    stage.forward(StepBatch(slots=slots, starts=[0] * batch, lengths=[len(PROMPT)] * batch, tokens=PROMPT * batch))
    last, tokens, logprobs = [PROMPT[-1] + s for s in range(batch)], [], []
    for i in range(steps):
        out = stage.forward(StepBatch(slots=slots, starts=[len(PROMPT) + i] * batch, lengths=[1] * batch, tokens=last))
        last = [int(t) for t in out.tokens]
        tokens.append(last)
        logprobs.append(out.logprobs.copy())
    return np.array(tokens), np.array(logprobs)


def test_prefetched_experts_give_the_same_tokens_and_logprobs(micro_model):  # noqa: F811
    stage = _stage(micro_model)
    cache = stage.experts
    assert cache.num_reserved == 2 and 0 not in cache.free and 1 not in cache.free
    with_prefetch = _decode(stage, slot=0)
    stats = cache.prefetch.stats()  # (as cache.stats() reports it; the simulator has no memory info)
    assert stats["prefetched"] > 0 and stats["prefetch_used"] > 0  # it ran, and was right at least once
    assert stats["prefetched"] == stats["prefetch_used"] + stats["prefetch_wasted"]
    assert all(int(cache.slot_key[s]) == -1 for s in range(2))  # the banks never hold a cached expert
    prefetch, cache.prefetch = cache.prefetch, None  # the same sequence on another KV slot, read in place
    without = _decode(stage, slot=1)
    assert prefetch.prefetched == stats["prefetched"]  # no prefetch ran
    np.testing.assert_array_equal(with_prefetch[0], without[0])
    np.testing.assert_array_equal(with_prefetch[1], without[1])


def test_the_plan_from_logits_gives_the_same_tokens_and_logprobs(micro_model, monkeypatch):  # noqa: F811
    """MOEBUS_PREFETCH_PLAN_FROM_LOGITS: the side branch ranks the router's logits in the plan kernel."""
    from moebus.workers import prefetch as prefetch_module

    monkeypatch.setattr(prefetch_module, "PLAN_FROM_LOGITS", True)
    stage = _stage(micro_model)
    cache = stage.experts
    with_prefetch = _decode(stage, slot=0)
    assert cache.prefetch.prefetched > 0 and cache.prefetch.used > 0
    cache.prefetch = None
    without = _decode(stage, slot=1)
    np.testing.assert_array_equal(with_prefetch[0], without[0])
    np.testing.assert_array_equal(with_prefetch[1], without[1])


def test_prefetched_experts_in_tiles_on_tensor_cores_give_the_same_tokens_and_logprobs(micro_model,  # noqa: F811
                                                                                      monkeypatch):
    """Batch 4 over 4 experts of top-2 (2 pairs an expert): the experts run in tiles (HostBlas stands in
    for cuBLAS in the simulator), which plan from the layer's placement row with the prefetched experts
    at their banks."""
    from moebus.cuda.kernels.gemm import TensorCores
    from moebus.workers import expert_cache, moe_prefill, stage as stage_module

    monkeypatch.setattr(moe_prefill, "DECODE_PAIRS_PER_EXPERT", 2)
    monkeypatch.setattr(expert_cache, "MISSES_IN_GEMVS_UP_TO", 0)  # tiles, though the cache is partial
    rows = []
    inner = moe_prefill.grouped_moe_placed
    monkeypatch.setattr(stage_module, "grouped_moe_placed", lambda *a: rows.append(a[4]) or inner(*a))
    stage = _stage(micro_model, kv_slots=8)
    stage.ops.tensor_cores = TensorCores(_blas(), min_rows=33, few_rows=2)
    cache = stage.experts
    with_prefetch = _decode(stage, slot=0, steps=2, batch=4)
    assert len(rows) == 6  # the prompts and 2 steps, 2 layers each, in tiles
    assert cache.prefetch.prefetched > 0 and cache.prefetch.used > 0
    cache.prefetch = None
    without = _decode(stage, slot=4, steps=2, batch=4)
    np.testing.assert_array_equal(with_prefetch[0], without[0])
    np.testing.assert_array_equal(with_prefetch[1], without[1])


def test_a_partial_cache_reads_decode_misses_in_the_gemvs_not_in_tiles(micro_model, monkeypatch):  # noqa: F811
    """expert_cache.MISSES_IN_GEMVS_UP_TO (8 by default): where the cache cannot hold every expert,
    batch 4 (2 pairs an expert, enough for tiles) runs its experts on the GEMV kernels; the prompts'
    step of 12 tokens keeps the tiles."""
    from moebus.cuda.kernels.gemm import TensorCores
    from moebus.workers import moe_prefill, stage as stage_module

    monkeypatch.setattr(moe_prefill, "DECODE_PAIRS_PER_EXPERT", 2)
    calls = []
    inner = moe_prefill.grouped_moe_placed
    monkeypatch.setattr(stage_module, "grouped_moe_placed", lambda *a: calls.append(a[2].shape[0]) or inner(*a))
    stage = _stage(micro_model, kv_slots=4)
    stage.ops.tensor_cores = TensorCores(_blas(), min_rows=33, few_rows=2)
    assert not stage.experts.decode_tiles(4)  # 4 slots for 8 experts
    _decode(stage, slot=0, steps=2, batch=4)
    assert calls == [12, 12] and stage.experts.prefetch.used > 0  # the prompts' 2 layers only


def test_no_prefetch_where_the_cache_holds_every_expert(micro_model):  # noqa: F811
    ckpt = Checkpoint(micro_model)
    cache = build_expert_cache(ckpt, range(2), make_backend("cuda"), prefetch_slots=1)
    assert cache.prefetch is None and cache.num_reserved == 0


def test_copies_after_the_experts_give_the_same_tokens_and_logprobs(micro_model, monkeypatch):  # noqa: F811
    """MOEBUS_PREFETCH_COPY_AFTER_EXPERTS: the next layer's copies are launched by the stage right after
    this layer's expert kernels (not by the join), and change nothing that comes out."""
    import sys

    from moebus.workers import prefetch as prefetch_module

    monkeypatch.setattr(prefetch_module, "COPY_AFTER_EXPERTS", True)
    launched_by = []
    after_experts = Prefetch.after_experts

    def spy(self, ops):
        if self._copy_args is not None:
            launched_by.append(sys._getframe(1).f_code.co_name)
        after_experts(self, ops)

    monkeypatch.setattr(Prefetch, "after_experts", spy)
    stage = _stage(micro_model)
    cache = stage.experts
    with_prefetch = _decode(stage, slot=0, steps=2)
    assert cache.prefetch.prefetched > 0 and cache.prefetch.used > 0
    assert launched_by and set(launched_by) == {"_moe_routed"}  # the stage's hook, never the join's flush
    cache.prefetch = None
    without = _decode(stage, slot=1, steps=2)
    np.testing.assert_array_equal(with_prefetch[0], without[0])
    np.testing.assert_array_equal(with_prefetch[1], without[1])
