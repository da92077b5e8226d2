"""Decode graphs captured before serving (workers/graph_warmup.py, gpu_worker.warm_decode_graphs): every
batch size up to max_batch and its grammar-masked twin are captured once, all sharing one scratch
pool, and a run whose batch size changes from step to step then captures nothing more and gives
the eager path's tokens and logprobs bit for bit (on a GPU: CUDA graphs do not exist in the simulator)."""
import numpy as np
import pytest

from moebus.cuda.backends.graphs import graphs_available
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel
from moebus.workers.graph_warmup import warm_decode_batch, warm_graphs, warm_sizes
from tests.cuda.test_launch_ahead import micro_model  # noqa: F401 - the fixture

SLOTS = 4
PROMPTS = [[5, 17, 42], [9, 77, 3, 8], [11, 2], [6, 6, 60, 1, 4]]
SIZES = [1, 3, 4, 2, 4, 1, 3, 2, 4]  # the running sequences of each decode step (a prefix of the slots)


def test_warm_sizes():
    assert warm_sizes(1) == [1]
    assert warm_sizes(8) == list(range(1, 9))
    assert warm_sizes(64) == list(range(1, 17)) + [32, 64]
    assert warm_sizes(40) == list(range(1, 17)) + [32, 40]


def test_warm_batch_is_a_valid_decode_step():
    class Stub:  # the fields warm_decode_batch reads of a stage
        is_first = is_last = True

        class cfg:
            vocab_size = 100

    batch = warm_decode_batch(Stub, 3, masked=True)
    assert batch.num_tokens == 3 and batch.mask.shape == (1, 4) and list(batch.mask_rows) == [0, -1, -1]
    assert warm_decode_batch(Stub, 2, masked=False).mask is None


def _run(model_dir, graphs: bool, monkeypatch):
    monkeypatch.setenv("MOEBUS_CUDA_GRAPHS", "1" if graphs else "0")
    model = LocalModel(model_dir, device="cuda", num_slots=SLOTS, max_context=64)
    stage = model.stages[0]
    warmed = warm_graphs(stage, range(1, SLOTS + 1))
    out = model.step(StepBatch(slots=range(SLOTS), starts=[0] * SLOTS, lengths=[len(p) for p in PROMPTS],
                               tokens=[t for p in PROMPTS for t in p], temperature=[0.0] * SLOTS))
    last, pos, seen = [int(t) for t in out.tokens], [len(p) for p in PROMPTS], []
    vocab = model.ckpt.config.vocab_size
    allowed = np.zeros((1, -(-vocab // 32)), np.uint32)
    allowed[0, :2] = 0xFFFFFFFF  # a grammar that allows ids 0..63 only
    captures = stage.graph_captures
    for i, n in enumerate(SIZES):
        masked = dict(mask=allowed, mask_rows=np.array([0] + [-1] * (n - 1), np.int32)) if i % 2 else {}
        out = model.step(StepBatch(slots=range(n), starts=pos[:n], lengths=[1] * n, tokens=last[:n],
                                   temperature=[0.0, 0.8, 0.0, 0.8][:n], u=[0.3, 0.6, 0.1, 0.9][:n], **masked))
        if masked:
            assert int(out.tokens[0]) < 64
        seen.append((out.tokens.copy(), out.logprobs.copy()))
        for j in range(n):
            last[j], pos[j] = int(out.tokens[j]), pos[j] + 1
    return warmed, stage.graph_captures - captures, stage.eager_short_steps, seen


@pytest.mark.skipif(not graphs_available(), reason="CUDA graphs need a GPU")
def test_warmed_graphs_serve_every_size_as_eager_does(micro_model, monkeypatch):  # noqa: F811
    warmed, later, _, graph_steps = _run(micro_model, True, monkeypatch)
    _, _, eager_steps, eager = _run(micro_model, False, monkeypatch)
    assert warmed == 2 * SLOTS and later == 0
    assert eager_steps == 1 + len(SIZES)  # the prompts' step (14 tokens) is a short step too
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(graph_steps, eager):
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_array_equal(logprobs, want_logprobs)
