"""A prompt chunk that spans steps on the cuda backend (workers/spanning_chunk.py). In the simulator:
its state kept in device buffers outside the step pool (a kept array survives begin_step, a buffer
is reused for the same shape) and given back when the chunk ends. On a GPU only (~55 s in the
simulator): a cache missing half the experts and a budget of one expert's copy a step; the chunk's
token and logprob are those of it run whole (the routed limit lowered so that micro-sized steps take
the long path)."""
import numpy as np
import pytest

from moebus.common import tiny_model
from moebus.cuda.backends import make_backend
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import TensorCores
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.workers import spanning_chunk
from moebus.workers import stage as stage_module
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel
from moebus.workers.moe_prefill import HostTiles
from tests.cuda.test_e2e import MICRO

CHUNK = [5, 17, 42, 9, 77, 3]


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tiny_model.PRESETS, "micro", MICRO)
        patch.setitem(tiny_model.PRESET_SHARDED, "micro", False)
        return tiny_model.init_model(tmp_path_factory.mktemp("micro"), "qwen3_moe", "micro")


def _stage(model_dir, budget_blobs: float, experts_on: str = "gemv"):
    model = LocalModel(model_dir, device="cuda", num_slots=2, max_context=16)
    stage = model.stages[0]
    if experts_on == "tensor cores":  # a step of 6 tokens on them (cuBLAS; HostBlas in the simulator)
        stage.ops.tensor_cores = TensorCores(HostBlas() if SIMULATOR else cublas_blas(), min_rows=3)
    else:
        stage.ops.tensor_cores = None
    stage.chunk_copy_budget_bytes = int(budget_blobs * stage.experts.store.blob_bytes)
    stage.forward(StepBatch(slots=[0], starts=[0], lengths=[2], tokens=[11, 12]))  # slot 0 decodes next
    experts = stage.experts
    experts.max_admissions = 1  # the decode rows' misses come back one a step
    for key in range(0, len(experts.store.blobs), 2):  # half of them out (the arena, 2 MiB, holds all)
        experts._evict(experts.key_slot[key])
    return stage


def test_kept_buffers_outlive_the_step_and_go_back_with_the_chunk():
    ops = make_backend("cuda")
    chunk = spanning_chunk.ChunkInProgress(slot=0, start=0, length=3, batch=StepBatch(slots=[0], starts=[0], lengths=[3]))
    ops.begin_step()
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    kept = chunk.keep(ops, "x", ops.upload(values))
    ops.begin_step()
    ops.upload(np.zeros((3, 4), np.float32))  # the step pool hands its buffers out again
    np.testing.assert_array_equal(ops.to_host(kept), values)
    assert chunk.keep(ops, "x", ops.upload(values + 1)) is kept and chunk.keep(ops, "x", kept) is kept
    np.testing.assert_array_equal(ops.to_host(kept), values + 1)

    class Holder:  # what release needs of a stage
        chunk = None
    holder = Holder()
    holder.chunk = chunk
    spanning_chunk.release(holder)
    assert holder.chunk is None and not chunk.kept


def test_an_input_uploaded_within_a_layer_outlives_the_layers_recycling():
    """chunk_advance.Uploads: the token slots read first by a layer's attention (after the layer
    mark) are read again by the next layer's: each layer's end keeps them, so the next layer's
    temporaries do not take their buffer."""
    from moebus.workers.chunk_advance import Uploads

    ops = make_backend("cuda")
    ops.begin_step()
    slots = np.arange(7, dtype=np.int32)
    inputs = Uploads(ops, {"token_slot": slots, "u": np.ones(1, np.float32)})
    mark = ops.layer_mark()
    for layer in range(2):
        got = inputs["token_slot"]
        temporary = ops.upload(np.full(7, -layer - 1, np.int32))  # the layer's own, same size
        np.testing.assert_array_equal(ops.to_host(got), slots)
        ops.recycle_layer(mark, (temporary if layer == 0 else None, *inputs.uploaded()))
    np.testing.assert_array_equal(ops.to_host(inputs["token_slot"]), slots)
    assert "u" in inputs and "mask" not in inputs and len(inputs.uploaded()) == 1  # "u" never read


@pytest.mark.skipif(SIMULATOR, reason="~55 s in the simulator: on a GPU (MOEBUS_TEST_GPU=1)")
@pytest.mark.parametrize("experts_on, by_time, staging", [("gemv", False, 0), ("tensor cores", False, 0),
                                                           ("tensor cores", True, 0), ("tensor cores", True, 2),
                                                           ("gemv", False, 2)])
def test_a_chunk_spanning_steps_on_device_buffers_equals_it_run_whole(micro_model, monkeypatch, experts_on, by_time,
                                                                      staging):
    """``tensor cores``: the threshold lowered so that the chunk's 6 tokens take the tiles
    (moe_prefill.HostTiles, as the chunk run whole does here: planned on the host), not the GEMVs.
    ``by_time``: each step's deadline past at its first look (chunk_advance.py), so a step runs one
    group and stops, also between layers (their hidden state kept in device buffers). ``staging``:
    the chunk's misses copied into that many slots of its loan (spanning_chunk_staging.py: the copy
    stream's fences, not the cache's)."""
    from moebus.workers import chunk_advance

    monkeypatch.setattr(chunk_advance, "STAGING_SLOTS", staging)
    monkeypatch.setattr(stage_module, "ROUTED_MAX_TOKENS", 4)  # a step of 7 tokens takes the long path
    groups = []
    run_group = HostTiles.run_group
    monkeypatch.setattr(HostTiles, "run_group", lambda self, *a: groups.append(a) or run_group(self, *a))
    whole = _stage(micro_model, 0, experts_on)
    want = whole.forward(StepBatch(slots=[1], starts=[0], lengths=[6], tokens=CHUNK))
    whole_groups = len(groups)
    sliced = _stage(micro_model, 1.0, experts_on)
    sliced.chunk_time_share = 1e-12 if by_time else 0.0
    assert len(sliced.experts.key_slot) < 8
    steps, between_layers, staged = 0, 0, []
    while True:
        out = sliced.forward(StepBatch(slots=[0, 1], starts=[2, 0], lengths=[1, 6], tokens=[21] + CHUNK))
        steps += 1
        if out.pending_rows is None:
            break
        assert (sliced.chunk.staging is not None) == (staging > 0)
        staged.append(0 if sliced.chunk.staged is None else sliced.chunk.staged.copies)
        kept = sliced.chunk.kept
        assert kept and not any(isinstance(b, np.ndarray) for b in kept.values())  # device buffers
        between_layers += sliced.chunk.within is None
        assert steps < 40
    assert steps > 1 and sliced.chunk is None and sliced.chunks_spanned == 1
    assert (between_layers > 0) == by_time and (max(staged) > 0) == (staging > 0)
    assert (whole_groups > 0 and len(groups) > whole_groups) == (experts_on == "tensor cores")
    assert out.tokens[1] == want.tokens[0]
    np.testing.assert_allclose(out.logprobs[1], want.logprobs[0], atol=1e-4)


@pytest.mark.skipif(SIMULATOR, reason="~55 s in the simulator: on a GPU (MOEBUS_TEST_GPU=1)")
def test_a_chunk_under_a_step_cap_equals_it_run_whole(micro_model, monkeypatch):
    """spanning_chunk.STEP_MS (MOEBUS_CHUNK_STEP_MS), past once the decode rows are done: the chunk's
    first step, its rows run synchronously, does no chunk work (no loan, nothing kept); the next sets
    it up, then one unit a step; its token and logprob are those of the chunk run whole."""
    monkeypatch.setattr(spanning_chunk, "STEP_MS", 1e-9)
    monkeypatch.setattr(stage_module, "ROUTED_MAX_TOKENS", 4)  # a step of 7 tokens takes the long path
    whole = _stage(micro_model, 0, "tensor cores")
    want = whole.forward(StepBatch(slots=[1], starts=[0], lengths=[6], tokens=CHUNK))
    sliced = _stage(micro_model, 1.0, "tensor cores")
    sliced.chunk_time_share = 1.0
    out = sliced.forward(StepBatch(slots=[0, 1], starts=[2, 0], lengths=[1, 6], tokens=[21] + CHUNK))
    held = sliced.chunk
    assert out.pending_rows.tolist() == [1] and held.idle_steps == held.steps == 1
    assert held.lent is None and held.x is None and not held.kept
    steps = 1
    while out.pending_rows is not None:
        out = sliced.forward(StepBatch(slots=[0, 1], starts=[2, 0], lengths=[1, 6], tokens=[21] + CHUNK))
        steps += 1
        assert steps < 60
    assert steps > 2 and sliced.chunk is None and sliced.chunks_spanned == 1
    assert out.tokens[1] == want.tokens[0]
    np.testing.assert_allclose(out.logprobs[1], want.logprobs[0], atol=1e-4)


@pytest.mark.skipif(SIMULATOR, reason="captured graphs: on a GPU (MOEBUS_TEST_GPU=1)")
def test_decode_rows_launched_beside_the_chunk_equal_them_waited_for(micro_model, monkeypatch):
    """chunk_rows.py (``stage.chunk_overlap``): from the chunk's second step the decode row is
    launched as its captured graph, the chunk's groups are enqueued behind it (their copies waiting
    for it) and the row is read after them. Each step's decode token and the chunk's token equal
    those of the same steps with the row waited for first. The decode rows admit nothing
    (``max_admissions = 0``): their admissions land when their copies are done (a timing) and, waited
    for, before the chunk plans its groups, overlapped, after; either changes which of the chunk's
    experts miss and so its steps (call 1: 2 steps waited, 3 overlapped). With only the chunk's own
    copies (one expert's bytes a step, no time bound: ``chunk_time_share`` 0) both runs take the
    same steps."""
    from moebus.workers import chunk_rows

    monkeypatch.setattr(stage_module, "ROUTED_MAX_TOKENS", 4)
    launched = []
    launch_rows = chunk_rows.launch_rows
    monkeypatch.setattr(spanning_chunk, "launch_rows", lambda *a: launched.append(launch_rows(*a)) or launched[-1])
    runs = []
    for overlap in (False, True):
        stage = _stage(micro_model, 1.0, "tensor cores")
        assert stage.use_graphs and stage.chunk_time_share == 0.0
        stage.chunk_overlap = overlap
        stage.experts.max_admissions = 0  # the cache changes by the chunk's copies alone (see above)
        stage.replay_s = None  # no replay's time to go by: the chunk's first step waits for its row
        got, position = [], 2
        while True:
            out = stage.forward(StepBatch(slots=[0, 1], starts=[position, 0], lengths=[1, 6], tokens=[21] + CHUNK))
            got.append(out)
            position += 1
            if out.pending_rows is None:
                break
            assert position < 40
        runs.append(got)
    waited, overlapped = runs
    assert len(waited) == len(overlapped) > 2
    assert sum(x is not None for x in launched) == len(overlapped) - 1  # all but the chunk's first step
    for a, b in zip(waited, overlapped):
        assert a.tokens[0] == b.tokens[0]
        np.testing.assert_allclose(a.logprobs[0], b.logprobs[0], atol=1e-5)
    assert waited[-1].tokens[1] == overlapped[-1].tokens[1]
    np.testing.assert_allclose(waited[-1].logprobs[1], overlapped[-1].logprobs[1], atol=1e-5)
