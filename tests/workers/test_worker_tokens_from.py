"""A STEP with ``tokens_from`` (a look-ahead step, broker/lookahead.py) runs on the ids the worker's
stage sampled in the step it names: the same result as that step's ids sent in full. A step naming
another step, or sent to a stage that is not the whole model, is refused by name."""
import numpy as np
import pytest

from moebus.common.protocol import Step
from moebus.workers.gpu_worker import GpuWorker
from moebus.workers.local import LocalModel


class NoLink:
    generation = "g"
    dropped_messages = 0


def step(step_id: int, starts, tokens=None, tokens_from=None, tokens_rows=None, slots=None) -> Step:
    """A step of one token per row (a decode step), or of ``tokens`` split evenly (a prefill)."""
    n = len(starts)
    length = 1 if tokens is None else len(tokens) // n
    slots = np.arange(n, dtype=np.int32) if slots is None else np.array(slots, np.int32)
    return Step(step_id=step_id, slots=slots, starts=np.array(starts, np.int32), tokens_rows=tokens_rows,
                lengths=np.full(n, length, np.int32), tokens=None if tokens is None else np.array(tokens, np.int32),
                tokens_from=tokens_from, temperature=np.zeros(n, np.float32), u=np.zeros(n, np.float32))


def worker(tiny_model, parts=1) -> GpuWorker:
    model = LocalModel(tiny_model, num_slots=2, max_context=32, parts=parts)
    return GpuWorker(model.stages[0], NoLink(), gpu=0)


def test_a_look_ahead_step_runs_on_the_ids_just_sampled(tiny_model):
    ahead, plain = worker(tiny_model), worker(tiny_model)
    prefill = [5, 6, 7, 8, 9, 10]
    first = ahead.step(step(1, [0, 0], tokens=prefill))
    assert plain.step(step(1, [0, 0], tokens=prefill)).tokens.tolist() == first.tokens.tolist()
    got = ahead.step(step(2, [3, 3], tokens_from=1))
    want = plain.step(step(2, [3, 3], tokens=first.tokens))
    assert got.tokens.tolist() == want.tokens.tolist()
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    assert ahead.step(step(3, [4, 4], tokens_from=2)).tokens.tolist() == \
        plain.step(step(3, [4, 4], tokens=want.tokens)).tokens.tolist()


def test_a_look_ahead_step_over_some_rows_takes_their_ids(tiny_model):
    ahead, plain = worker(tiny_model), worker(tiny_model)
    prefill = [5, 6, 7, 8, 9, 10]
    first = ahead.step(step(1, [0, 0], tokens=prefill))
    plain.step(step(1, [0, 0], tokens=prefill))
    got = ahead.step(step(2, [3], tokens_from=1, tokens_rows=np.array([1], np.int32), slots=[1]))
    want = plain.step(step(2, [3], tokens=first.tokens[1:], slots=[1]))
    assert got.tokens.tolist() == want.tokens.tolist()
    with pytest.raises(ValueError, match="another batch size"):  # a row the named step does not have
        ahead.step(step(3, [4], tokens_from=2, tokens_rows=np.array([1], np.int32), slots=[1]))


def test_a_look_ahead_step_must_follow_the_step_it_names(tiny_model):
    w = worker(tiny_model)
    with pytest.raises(ValueError, match="not the last step this worker sampled"):
        w.step(step(2, [3], tokens_from=1))  # nothing sampled yet
    w.step(step(1, [0], tokens=[5, 6, 7]))
    with pytest.raises(ValueError, match="not the last step"):
        w.step(step(3, [3], tokens_from=2))
    with pytest.raises(ValueError, match="another batch size"):
        w.step(step(2, [3, 3], tokens_from=1))


def test_only_a_stage_that_is_the_whole_model_takes_its_own_ids(tiny_model):
    with pytest.raises(ValueError, match="not the whole model"):
        worker(tiny_model, parts=2).step(step(2, [3], tokens_from=1))
