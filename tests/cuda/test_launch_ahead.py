"""Decode steps launched while the one before still runs (workers/overlap.py, on a GPU only: CUDA
graphs do not exist in the simulator): a worker whose inbox already holds the broker's look-ahead
STEPs launches each one ahead, feeding it the ids the step before sampled on the device, and gives
the tokens and logprobs of the same steps replayed one at a time with their ids sent in full."""
import numpy as np
import pytest

from moebus.common import tiny_model
from moebus.common.protocol import Step
from moebus.cuda.backends.graphs import graphs_available
from moebus.workers.batch import StepBatch
from moebus.workers.gpu_worker import GpuWorker
from moebus.workers.link import Inbox
from moebus.workers.local import LocalModel
from tests.cuda.test_e2e import MICRO

pytestmark = pytest.mark.skipif(not graphs_available(), reason="CUDA graphs need a GPU")
PROMPT = [5, 17, 42, 9, 77, 3]
NUM_STEPS = 12


class InboxLink:
    """The compute thread's side of a BrokerLink: its inbox, which the test fills as the broker would."""

    generation = "g"
    dropped_messages = 0

    def __init__(self):
        self.inbox = Inbox()

    def peek(self, timeout_s: float):
        return self.inbox.peek(timeout_s)


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tiny_model.PRESETS, "micro", MICRO)
        patch.setitem(tiny_model.PRESET_SHARDED, "micro", False)
        return tiny_model.init_model(tmp_path_factory.mktemp("micro"), "qwen3_moe", "micro")


def decode_step(step_id: int, start: int, rows: int) -> Step:
    return Step(step_id=step_id, tokens_from=step_id - 1, slots=np.arange(rows, dtype=np.int32),
                starts=np.full(rows, start, np.int32), lengths=np.ones(rows, np.int32),
                temperature=np.array([0.0, 0.7][:rows], np.float32), u=np.full(rows, 0.3, np.float32))


def prefill_step(rows: int) -> Step:
    return Step(step_id=1, slots=np.arange(rows, dtype=np.int32), starts=np.zeros(rows, np.int32),
                lengths=np.full(rows, len(PROMPT), np.int32), tokens=np.array(PROMPT * rows, np.int32),
                temperature=np.array([0.0, 0.7][:rows], np.float32), u=np.full(rows, 0.3, np.float32))


def decode_around_a_reserve(worker, link, prefill: Step, vram) -> tuple[list, list]:
    """The prefill, then NUM_STEPS decode steps queued with ``vram`` behind the middle one, as the broker's
    hand-back sends them: (the steps' replies, the VRAM's)."""
    got = [worker.step(prefill)]
    for i in range(NUM_STEPS):
        link.inbox.put(decode_step(2 + i, len(PROMPT) + i, len(prefill.slots)))
        if i == NUM_STEPS // 2:
            link.inbox.put(vram)
    replies = []
    while not link.inbox.empty():
        message = link.inbox.get()
        reply = worker.handle(message)
        (got if isinstance(message, Step) else replies).append(reply)
    return got, replies


def steps_one_at_a_time(model_dir, prefill: Step, rows: int, **model_options) -> list:
    """The prefill and NUM_STEPS decode steps on a fresh model, each with the ids sent in full."""
    model = LocalModel(model_dir, device="cuda", num_slots=2, max_context=64, **model_options)
    want = [model.step(StepBatch(slots=prefill.slots, starts=prefill.starts, lengths=prefill.lengths,
                                 tokens=prefill.tokens, temperature=prefill.temperature, u=prefill.u))]
    for i in range(NUM_STEPS):
        step = decode_step(2 + i, len(PROMPT) + i, rows)
        want.append(model.step(StepBatch(slots=step.slots, starts=step.starts, lengths=step.lengths,
                                          tokens=want[-1].tokens, temperature=step.temperature, u=step.u)))
    return want


@pytest.mark.parametrize("rows", [1, 2])
def test_launched_ahead_steps_give_the_tokens_of_steps_run_one_at_a_time(micro_model, rows):
    link = InboxLink()
    worker = GpuWorker(LocalModel(micro_model, device="cuda", num_slots=2, max_context=64).stages[0], link, gpu=0)
    prefill = prefill_step(rows)
    got = [worker.step(prefill)]
    for i in range(NUM_STEPS):
        link.inbox.put(decode_step(2 + i, len(PROMPT) + i, rows))
    while not link.inbox.empty():
        got.append(worker.step(link.inbox.get()))
    assert worker.steps_launched_ahead == NUM_STEPS - 1  # every decode step but the first

    want = steps_one_at_a_time(micro_model, prefill, rows)
    assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]
    np.testing.assert_array_equal(np.array([g.logprobs for g in got]), np.array([w.logprobs for w in want]))


def test_a_vram_request_between_steps_is_applied_between_them(micro_model):
    """The vision hand-back's VRAM goes to a worker with look-ahead steps queued around it: the
    worker never launches the step after it early (it launches ahead only its next message), so
    the resize runs with nothing in flight, and the tokens are those of steps run one at a time."""
    from moebus.common.protocol import Vram, VramReply

    rows, link = 2, InboxLink()
    worker = GpuWorker(LocalModel(micro_model, device="cuda", num_slots=2, max_context=64).stages[0], link, gpu=0)
    prefill = prefill_step(rows)
    got, replies = decode_around_a_reserve(worker, link, prefill, Vram(id="~resize-1", reserve_mib=0.0))
    assert len(replies) == 1 and isinstance(replies[0], VramReply) and replies[0].error is None
    assert worker.steps_launched_ahead == NUM_STEPS - 2  # all but the first and the one after the VRAM

    want = steps_one_at_a_time(micro_model, prefill, rows)
    assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]


@pytest.mark.parametrize("rows", [1, 2])
def test_local_decode_launches_ahead_and_gives_the_tokens_of_steps_one_at_a_time(micro_model, rows, monkeypatch):
    """LocalModel.decode (in-process launch-ahead, overlap.decode_ahead): every decode step but the
    first launched after the one before it, and a caller that stops early leaves nothing in flight."""
    from moebus.workers import overlap

    launched_after = []
    launch = overlap.launch

    def counting_launch(stage, batch, step_id, after=None):
        out = launch(stage, batch, step_id, after=after)
        launched_after.append(out is not None and after is not None)
        return out

    monkeypatch.setattr(overlap, "launch", counting_launch)
    prefill = prefill_step(rows)
    batches = [StepBatch(slots=prefill.slots, starts=prefill.starts, lengths=prefill.lengths, tokens=prefill.tokens,
                         temperature=prefill.temperature, u=prefill.u)]
    for i in range(NUM_STEPS):
        step = decode_step(2 + i, len(PROMPT) + i, rows)
        batches.append(StepBatch(slots=step.slots, starts=step.starts, lengths=step.lengths,
                                 tokens=np.zeros(rows, np.int32), temperature=step.temperature, u=step.u))
    model = LocalModel(micro_model, device="cuda", num_slots=2, max_context=64)
    got = list(model.decode(batches))
    assert sum(launched_after) == NUM_STEPS - 1

    want = steps_one_at_a_time(micro_model, prefill, rows)
    assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]
    np.testing.assert_array_equal(np.array([g.logprobs for g in got]), np.array([w.logprobs for w in want]))
    first = model.decode(batches)
    for _ in range(4):
        next(first)
    first.close()  # the step launched ahead is collected: the stream is idle, the graph's buffers free
    assert all(launch.is_done() for graph in model.stages[0].graphs.values() for launch in graph.launches or ())


def test_a_reserve_that_unmaps_launches_the_next_step_beside_it(tmp_path_factory, monkeypatch):
    """MOEBUS_HANDBACK_BESIDE_STEP=1: a hand-back request that releases segments of a cache that evicts
    (VMM segments of 2 MiB, 1.5 MiB experts, half of them cached) launches the step queued behind it once
    the leaving slots are out of service, and unmaps them while it runs; the tokens are those of steps run
    one at a time on a cache that holds every expert."""
    from moebus.common.protocol import Vram
    from tests.cuda.test_e2e import init_micro

    wide = init_micro(tmp_path_factory, "micro_wide", hidden_size=256, moe_intermediate_size=1024, num_experts=8,
                      num_experts_per_tok=2)
    monkeypatch.setenv("MOEBUS_HANDBACK_BESIDE_STEP", "1")
    rows, link = 2, InboxLink()
    options = {"cache_fraction": 0.5, "elastic": True, "prefetch_slots": 0}  # the reference runs the same kernels
    stage = LocalModel(wide, device="cuda", num_slots=2, max_context=64, **options).stages[0]
    slots_before = stage.experts.num_slots
    stage.experts.arena.memory_info = lambda: (0, 1 << 34)  # the reserve finds nothing free: it releases segments
    worker = GpuWorker(stage, link, gpu=0)
    prefill = prefill_step(rows)
    got, replies = decode_around_a_reserve(worker, link, prefill, Vram(id="~resize-1", reserve_mib=4.0))
    assert len(replies) == 1 and replies[0].error is None and replies[0].expert_slots < slots_before
    assert stage.experts.last_resize.get("beside") is True and worker.steps_launched_beside == 1
    assert worker.steps_launched_ahead == NUM_STEPS - 2  # launch_next's: all but the first and the one beside

    want = steps_one_at_a_time(wide, prefill, rows, **options)
    assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]
    np.testing.assert_array_equal(np.array([g.logprobs for g in got]), np.array([w.logprobs for w in want]))
