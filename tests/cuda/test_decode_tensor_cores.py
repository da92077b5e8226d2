"""Decode steps of a few sequences on tensor cores (gemm.FEW_ROWS, moe_prefill.DECODE_PAIRS_PER_EXPERT)
and routed steps with a prompt's chunk beside decode rows, captured as graphs (Stage._graph_for). In
the simulator HostBlas stands in for cuBLAS; on a GPU (MOEBUS_TEST_GPU=1) cuBLAS runs and the
captured steps are checked against the eager ones bit for bit."""
import numpy as np
import pytest

from moebus.cuda.backends.cuda import CudaBackend
from moebus.cuda.backends.graphs import graphs_available
from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import TensorCores, gemm_linear_ref, sum_parts_cuda
from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas
from moebus.cuda.kernels.grouped_moe import tile_pairs
from moebus.cuda.dtypes import f32_to_bf16
from moebus.workers import moe_prefill
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel
from tests.cuda.conftest import device
from tests.cuda.test_e2e import micro_model  # noqa: F401 - the fixture
from tests.cuda.test_prefill_tensor_cores import CountingBlas


def _blas():
    return CountingBlas(HostBlas() if SIMULATOR else cublas_blas())


def test_sum_parts_adds_each_part(rng):
    y = rng.standard_normal((2, 3, 37), dtype=np.float32)
    ops = CudaBackend()
    ops.begin_step()
    out = sum_parts_cuda(device(y), ops.empty((3, 37)))
    np.testing.assert_array_equal(out.copy_to_host(), y[0] + y[1])


@pytest.mark.parametrize("rows", [2, 8, 20])
def test_a_few_rows_take_one_product_over_both_parts(rng, rows):
    ops = CudaBackend()
    blas = _blas()
    ops.tensor_cores = TensorCores(blas, min_rows=33, few_rows=2)
    ops.begin_step()
    x = rng.standard_normal((rows, 96), dtype=np.float32)
    weight = f32_to_bf16(rng.standard_normal((136, 96), dtype=np.float32) * 0.1)
    got = ops.linear(device(x), device(weight)).copy_to_host()
    assert blas.calls == 1  # the weights read once: hi and lo rows are one product's columns
    np.testing.assert_allclose(got, gemm_linear_ref(x, weight), rtol=1e-5, atol=1e-5)


def test_few_rows_threshold():
    tc = TensorCores(HostBlas(), min_rows=33, few_rows=8)
    bf16, f32 = np.zeros((4, 4), np.uint16), np.zeros((4, 4), np.float32)
    assert tc.takes_linear(8, bf16) and tc.takes_linear(32, bf16) and tc.takes_linear(40, bf16)
    assert not tc.takes_linear(7, bf16) and not tc.takes_linear(8, f32)
    assert not tc.wants(8, bf16)  # the towers' and prefill's products keep min_rows
    assert not TensorCores(HostBlas(), min_rows=33, few_rows=0).takes_linear(8, bf16)  # 0: never


def test_decode_tiles_hold_at_least_the_decode_minimum():
    assert tile_pairs(2 * 64, 32, least=8) == 8  # batch 8 over 32 experts: 16-row tiles
    assert tile_pairs(2 * 512, 32, least=8) == 32  # batch 64: as before
    assert tile_pairs(2 * 64, 32) == 16  # prefill's least


def test_a_decode_step_of_four_on_tensor_cores_matches_the_cpu_device(micro_model, monkeypatch):  # noqa: F811
    """The micro model's 4 experts, top 2: batch 4 has 2 pairs per expert, the default threshold of
    the tiles; its dense products take the few-rows path (few_rows 2)."""
    monkeypatch.setattr(moe_prefill, "DECODE_PAIRS_PER_EXPERT", 2)
    placed = []
    from moebus.workers import stage

    inner = moe_prefill.grouped_moe_placed
    monkeypatch.setattr(stage, "grouped_moe_placed", lambda *a: placed.append(1) or inner(*a))
    cpu = LocalModel(micro_model, device="cpu", max_context=32)
    cuda = LocalModel(micro_model, device="cuda", max_context=32, prefetch_slots=0)
    blas = _blas()
    cuda.backend.tensor_cores = TensorCores(blas, min_rows=33, few_rows=2)
    prompts = StepBatch(slots=[0, 1, 2, 3], starts=[0] * 4, lengths=[5, 4, 3, 3], tokens=list(range(20, 35)))
    want, got = cpu.step(prompts), cuda.step(prompts)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    for n in range(3):
        step = StepBatch(slots=[0, 1, 2, 3], starts=[5 + n, 4 + n, 3 + n, 3 + n], lengths=[1] * 4,
                         tokens=list(want.tokens))
        calls = blas.calls
        want, got = cpu.step(step, want_logits=True), cuda.step(step, want_logits=True)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-3)
        assert blas.calls > calls or cuda.stages[0].use_graphs  # a replayed graph calls nothing from Python
    assert placed


@pytest.mark.skipif(not graphs_available(), reason="CUDA graphs need a GPU")
def test_a_chunk_beside_decode_rows_is_captured_from_its_second_step(micro_model):  # noqa: F811
    """Two sequences decode while a third's prompt is read 3 tokens a step: the first such step runs
    eagerly (asked twice for its graph, it counts once), the next ones replay one graph, and every step
    gives the eager path's logits bit for bit."""
    prompt = list(range(40, 52))

    def run(graphs: bool):
        model = LocalModel(micro_model, device="cuda", num_slots=3, max_context=32)
        model.stages[0].use_graphs = graphs and model.stages[0].use_graphs
        out = model.step(StepBatch(slots=[0, 1], starts=[0, 0], lengths=[3, 2], tokens=[5, 17, 42, 9, 77]))
        last, seen = [int(t) for t in out.tokens], []
        for n in range(4):
            batch = StepBatch(slots=[0, 1, 2], starts=[3 + n, 2 + n, 3 * n], lengths=[1, 1, 3],
                              tokens=last + prompt[3 * n:3 * n + 3])
            stage = model.stages[0]
            stage._graph_for(batch, stage._host_inputs(batch, None))  # as a worker's launch-ahead asks first
            out = model.step(batch, want_logits=True)
            seen.append(out.logits.copy())
            last = [int(t) for t in out.tokens[:2]]
        return model.stages[0], seen

    stage, captured = run(True)
    _, eager = run(False)
    assert (5, False, 3) in stage.graphs and stage.eager_short_steps == 2  # the prompts, the first chunk
    for a, b in zip(captured, eager):
        np.testing.assert_array_equal(a, b)


def test_a_chunk_shape_that_cannot_be_captured_runs_eagerly_and_decode_keeps_its_graphs(micro_model,  # noqa: F811
                                                                                       monkeypatch):
    """(Anywhere: the capture is made to fail.) The chunk's shape is tried once, from its second step,
    then runs eagerly; the stage's decode graphs stay on."""
    from moebus.cuda.backends import graphs

    attempts = []

    def failing_capture(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("no capture here")

    monkeypatch.setattr(graphs, "CapturedStep", failing_capture)
    model = LocalModel(micro_model, device="cuda", num_slots=3, max_context=32)
    stage = model.stages[0]
    stage.use_graphs = True
    for n in range(3):
        batch = StepBatch(slots=[0, 1], starts=[2 * n, 0 if n == 0 else 3 + n], lengths=[2, 3 if n == 0 else 1],
                          tokens=[40 + n, 41 + n] + ([5, 17, 42] if n == 0 else [9]))
        if n == 0:  # the prompts: 5 tokens of 2 sequences; then a chunk of 2 beside one decode row
            model.step(batch)
            continue
        inputs = stage._host_inputs(batch, None)
        assert stage._graph_for(batch, inputs) is None
    assert len(attempts) == 1 and stage.use_graphs  # tried at the chunk's second step only
