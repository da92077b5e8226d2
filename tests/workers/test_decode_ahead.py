"""In-process decode with launch-ahead (LocalModel.decode, overlap.decode_ahead): each step is
launched before the outputs of the one before are read, its tokens the ids that step sampled on the
device. The order of launches and waits is checked with a fake device whose "model" adds one to
each token; the tiny model on cpu (where nothing launches) gives the tokens of steps run in turn."""
import numpy as np
import pytest

from moebus.workers import overlap
from moebus.workers.batch import StageOutput, StepBatch
from moebus.workers.local import LocalModel


class FakeDevice:
    """overlap.launch / finish on a device whose step samples token + 1 for each row; a batch whose
    ``extras`` says ``eager`` cannot be launched (as a step with top logprobs)."""

    def __init__(self):
        self.events = []

    def launch(self, stage, batch, step_id, after=None):
        if batch.extras.get("eager") or batch.num_tokens != batch.num_seqs:
            return None
        tokens = after.launch if after is not None else batch.tokens  # the ids of the step in flight
        self.events.append(("launch", step_id, None if after is None else after.step_id))
        return overlap.Launched(step_id, batch, graph=None, launch=tokens + 1)

    def finish(self, stage, launched):
        self.events.append(("finish", launched.step_id))
        return StageOutput(tokens=launched.launch, logprobs=np.zeros(len(launched.launch), np.float32))

    def step(self, batch):
        self.events.append(("step", batch.tokens.tolist()))
        return StageOutput(tokens=batch.tokens[np.cumsum(batch.lengths) - 1] + 1,
                           logprobs=np.zeros(batch.num_seqs, np.float32))


@pytest.fixture
def device(monkeypatch):
    fake = FakeDevice()
    monkeypatch.setattr(overlap, "launch", fake.launch)
    monkeypatch.setattr(overlap, "finish", fake.finish)
    return fake


def decode_batch(start: int, eager: bool = False) -> StepBatch:
    return StepBatch(slots=[0, 1], starts=[start] * 2, lengths=[1, 1], tokens=[-1, -1],
                     extras={"eager": True} if eager else {})


def prompt_then(*decode) -> list[StepBatch]:
    return [StepBatch(slots=[0, 1], starts=[0, 0], lengths=[3, 3], tokens=[1, 2, 10, 4, 5, 20])] + list(decode)


def test_each_step_is_launched_before_the_one_before_is_read(device):
    outs = list(overlap.decode_ahead(None, prompt_then(*(decode_batch(3 + i) for i in range(3))), device.step))
    assert [o.tokens.tolist() for o in outs] == [[11, 21], [12, 22], [13, 23], [14, 24]]
    assert device.events == [("step", [1, 2, 10, 4, 5, 20]), ("launch", 1, None), ("launch", 2, 1), ("finish", 1),
                             ("launch", 3, 2), ("finish", 2), ("finish", 3)]


def test_a_step_that_cannot_launch_runs_after_the_one_in_flight_with_its_ids(device):
    batches = prompt_then(decode_batch(3), decode_batch(4, eager=True), decode_batch(5), decode_batch(6))
    outs = list(overlap.decode_ahead(None, batches, device.step))
    assert [o.tokens.tolist() for o in outs] == [[11, 21], [12, 22], [13, 23], [14, 24], [15, 25]]
    assert device.events == [("step", [1, 2, 10, 4, 5, 20]), ("launch", 1, None), ("finish", 1), ("step", [12, 22]),
                             ("launch", 3, None), ("launch", 4, 3), ("finish", 3), ("finish", 4)]


def test_a_caller_that_stops_early_still_collects_the_step_in_flight(device):
    steps = overlap.decode_ahead(None, prompt_then(*(decode_batch(3 + i) for i in range(5))), device.step)
    for out in steps:
        if out.tokens[0] == 12:
            break
    steps.close()
    assert device.events == [("step", [1, 2, 10, 4, 5, 20]), ("launch", 1, None), ("launch", 2, 1), ("finish", 1),
                             ("finish", 2)]


@pytest.mark.parametrize("launch_ahead", [True, False])
def test_local_decode_gives_the_tokens_of_steps_run_one_at_a_time(tiny_model, launch_ahead):
    prompt, steps = [5, 17, 99, 3, 42, 7], 6
    model = LocalModel(tiny_model, num_slots=2, max_context=32)
    want = [model.step(StepBatch(slots=[0, 1], starts=[0, 0], lengths=[6, 6], tokens=prompt * 2))]
    for i in range(steps):
        want.append(model.step(StepBatch(slots=[0, 1], starts=[6 + i] * 2, lengths=[1, 1], tokens=want[-1].tokens)))

    batches = [StepBatch(slots=[0, 1], starts=[0, 0], lengths=[6, 6], tokens=prompt * 2)]
    batches += [StepBatch(slots=[0, 1], starts=[6 + i] * 2, lengths=[1, 1], tokens=[0, 0]) for i in range(steps)]
    got = list(LocalModel(tiny_model, num_slots=2, max_context=32).decode(batches, launch_ahead))
    assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]
    np.testing.assert_array_equal([g.logprobs for g in got], [w.logprobs for w in want])


@pytest.mark.parametrize("launch_ahead", [True, False])
def test_a_step_that_does_not_take_one_token_a_sequence_is_refused_by_name(tiny_model, launch_ahead):
    batches = [StepBatch(slots=[0], starts=[0], lengths=[3], tokens=[5, 17, 99]),
               StepBatch(slots=[0], starts=[3], lengths=[2], tokens=[0, 0])]
    with pytest.raises(ValueError, match="one token a sequence"):
        list(LocalModel(tiny_model, max_context=32).decode(batches, launch_ahead))
