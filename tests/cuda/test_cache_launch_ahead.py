"""A cache that evicts, launching ahead (workers/overlap.py, MOEBUS_CACHE_LAUNCH_AHEAD; on a GPU only:
CUDA graphs do not exist in the simulator): the steps launched ahead, whose misses evict and admit
experts while the next step runs, give the tokens and logprobs of the same steps run one at a time;
and the placement table's uploads (workers/placement_upload.py) land in stream order from a few
buffers of their own."""
import numpy as np
import pytest

from moebus.common.checkpoint import Checkpoint
from moebus.cuda.backends import make_backend
from moebus.cuda.backends.graphs import graphs_available
from moebus.cuda.memory.vmm import DeviceArena
from moebus.workers import overlap
from moebus.workers.batch import StepBatch
from moebus.workers.expert_cache import ExpertCache
from moebus.workers.host_store import HostStore
from moebus.workers.placement_upload import DEPTH, PlacementUploads
from moebus.workers.prefetch import Prefetch
from moebus.workers.stage import Stage
from tests.cuda.test_e2e import micro_model  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not graphs_available(), reason="CUDA graphs need a GPU")
PROMPT = [5, 17, 42, 9, 77, 3]
NUM_STEPS = 16


def _stage(model_dir, slots_per_layer: int):
    """A stage over a cache of 4 of the micro model's 8 experts (and 2 bank slots with a prefetch)."""
    ckpt, backend = Checkpoint(model_dir), make_backend("cuda")
    store = HostStore(ckpt, range(2), allocate=backend.host_empty, device_view=backend.host_device_view)
    banks = 2 * slots_per_layer
    arena = DeviceArena(store.blob_bytes, store.dtype, [(4 + banks) * store.blob_bytes])
    arena.grow()
    prefetch = Prefetch(slots_per_layer, 2, store.num_experts, ckpt.config.top_k, store.blob_bytes) \
        if slots_per_layer else None
    cache = ExpertCache(store, arena, min_slots=ckpt.config.top_k + banks, prefetch=prefetch)
    cache.preload()
    return Stage(ckpt, range(2), backend, 2, 64, experts=cache)


def decode(model_dir, rows: int, launch_ahead: bool, slots_per_layer: int):
    """(tokens, logprobs, steps launched ahead, cache stats) of a prompt and NUM_STEPS decode steps."""
    stage = _stage(model_dir, slots_per_layer)
    batches = [StepBatch(slots=range(rows), starts=[0] * rows, lengths=[len(PROMPT)] * rows, tokens=PROMPT * rows)]
    batches += [StepBatch(slots=range(rows), starts=[len(PROMPT) + i] * rows, lengths=[1] * rows,
                          tokens=[0] * rows, temperature=[0.0, 0.7][:rows], u=[0.3] * rows) for i in range(NUM_STEPS)]
    launched = []
    launch = overlap.launch

    def counted(*args, **kwargs):
        out = launch(*args, **kwargs)
        launched.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(overlap, "launch", counted)
        outs = list(overlap.decode_ahead(stage, batches, stage.forward) if launch_ahead
                    else overlap.decode_ahead(stage, batches[:1], stage.forward))
        if not launch_ahead:  # one at a time, each fed the ids the step before sampled
            for batch in batches[1:]:
                outs.append(stage.forward(overlap.fed(batch, outs[-1].tokens)))
    c = stage.experts
    return [o.tokens.tolist() for o in outs], np.array([o.logprobs for o in outs]), sum(launched), (c.hits, c.misses)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("prefetch_slots", [0, 1])
def test_a_cache_that_evicts_launches_ahead_with_the_tokens_of_steps_in_turn(micro_model, rows, prefetch_slots,
                                                                             monkeypatch):  # noqa: F811
    want_tokens, want_logprobs, _, _ = decode(micro_model, rows, False, prefetch_slots)
    assert not decode(micro_model, rows, True, prefetch_slots)[2]  # without the switch: nothing launched ahead
    monkeypatch.setattr(overlap, "CACHE_LAUNCH_AHEAD", True)
    tokens, logprobs, launched, (hits, misses) = decode(micro_model, rows, True, prefetch_slots)
    assert launched == NUM_STEPS and misses > 0
    assert tokens == want_tokens
    np.testing.assert_array_equal(logprobs, want_logprobs)


def test_placement_uploads_land_in_stream_order_from_their_own_buffers():
    ops = make_backend("cuda")
    target = ops.persist(np.zeros((3, 5), np.int32))
    uploads = PlacementUploads(ops)
    pool_before = ops.staging_pool.allocated_bytes
    for i in range(3 * DEPTH):
        uploads.overwrite(target, np.full((3, 5), i, np.int32))
    assert np.array_equal(ops.to_host(target), np.full((3, 5), 3 * DEPTH - 1, np.int32))
    assert len(uploads.ring) == DEPTH and ops.staging_pool.allocated_bytes == pool_before
