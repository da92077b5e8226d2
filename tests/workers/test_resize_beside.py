"""A hand-back request with the next decode step launched beside it (ExpertCache._shrink_for's
``beside``, MOEBUS_HANDBACK_BESIDE_STEP): the step is launched once the leaving slots are out of service
(the table names none of them, the moves down are enqueued) and before they are unmapped, and the unmap
waits for the compute stream as it was before that launch, not for the step. On cpu nothing launches
(no CUDA graphs): the order and the hand-over are checked here, the tokens on a GPU
(tests/cuda/test_launch_ahead.py)."""
import numpy as np
import pytest

from moebus.bench.cache import TraceStore
from moebus.common.errors import ConfigError
from moebus.common.protocol import Step, Vram
from moebus.cuda.memory.arena import HostArena
from moebus.cuda.memory.ledger import MIB
from moebus.workers.expert_cache import ExpertCache
from moebus.workers.gpu_worker import GpuWorker, handback_beside_from_env
from moebus.workers.link import Inbox
from moebus.workers.local import LocalModel

LAYERS, EXPERTS = 2, 16


class RecordingArena(HostArena):
    """Segments of a slot each; records each shrink's ``after`` and what was mapped when it came."""

    def __init__(self, store, slots):
        super().__init__(store.blob_bytes, store.dtype, [store.blob_bytes] * slots)
        self.shrinks = []

    def shrink(self, num_segments, after=None):
        self.shrinks.append((num_segments, after, len(self.mapped)))
        return super().shrink(num_segments, after=after)


class FencedCopier:
    """A copier with compute-stream fences (as cuda's StreamCopier): hands out numbered events."""

    fences = True

    def __init__(self, arena):
        self.arena, self.events = arena, []

    def record_compute(self):
        event = f"event {len(self.events)}"
        self.events.append(event)
        return type("Fence", (), {"event": event, "seq": len(self.events)})()

    def copy(self, slot, blob, after=None):
        self.arena.write(slot, blob)
        return True

    def move(self, src, dst):
        self.arena.array[dst] = self.arena.array[src]

    def wait(self): pass
    def sync(self): pass
    def mark(self): pass
    def is_done(self): return True


def cache_of(copier_class=None, slots=24):
    store = TraceStore(LAYERS, EXPERTS)
    arena = RecordingArena(store, slots)
    arena.grow()
    cache = ExpertCache(store, arena, copier=copier_class(arena) if copier_class else None, min_slots=4)
    cache.preload()
    for step in range(6):  # some use, so the shrink has hot experts to keep
        cache.observe(np.array([[[step % 4, 5]], [[7, 8]]]))
    return cache, store


@pytest.mark.parametrize("fenced", [False, True])
def test_the_step_beside_is_launched_between_the_tables_change_and_the_unmap(fenced):
    cache, store = cache_of(FencedCopier if fenced else None)
    seen = {}

    def beside():
        seen["named"] = int((cache.placement >= 18).sum())  # entries still naming a leaving slot (18-23)
        seen["held"] = int((cache.slot_key[18:24] >= 0).sum()) + sum(s >= 18 for s in cache.free)
        seen["mapped"] = len(cache.arena.mapped)  # not unmapped yet
        seen["hot_resident"] = all(cache.placement[row, e] >= 0 for row, e in ((0, 5), (1, 7), (1, 8)))
        return True

    reserve_mib = 6 * store.blob_bytes / MIB  # six slots' worth (the host arena reports 0 free)
    report = cache.resize(reserve_mib, beside=beside)
    assert seen == {"named": 0, "held": 0, "mapped": 24, "hot_resident": True}
    assert report["expert_slots"] == 18 and cache.last_resize["beside"] is True
    (count, after, mapped_then), = cache.arena.shrinks
    assert count == 6 and mapped_then == 24
    # the unmap waits for the compute stream as it was before the launch: the event recorded just before it
    assert after == (cache.copier.events[-1] if fenced else None)


def test_no_beside_where_nothing_is_released():
    cache, store = cache_of()
    called = []
    cache.resize(0.0, beside=lambda: called.append(1) or True)  # 0 MiB: nothing to release
    cache.resize(None, beside=lambda: called.append(1) or True)  # a regrow never calls it
    assert not called and "beside" not in cache.last_resize
    assert cache.arena.shrinks == []


def test_the_switch():
    assert handback_beside_from_env({}) is True  # the default since the H200 measured it
    assert handback_beside_from_env({"MOEBUS_HANDBACK_BESIDE_STEP": "0"}) is False
    assert handback_beside_from_env({"MOEBUS_HANDBACK_BESIDE_STEP": "1"}) is True
    for text in ("yes", "2", "", " 1"):
        with pytest.raises(ConfigError, match="MOEBUS_HANDBACK_BESIDE_STEP must be 0 or 1"):
            handback_beside_from_env({"MOEBUS_HANDBACK_BESIDE_STEP": text})


class InboxLink:
    generation = "g"
    dropped_messages = 0

    def __init__(self):
        self.inbox = Inbox()

    def peek(self, timeout_s):
        return self.inbox.peek(timeout_s)


def decode_step(step_id, start):
    return Step(step_id=step_id, tokens_from=step_id - 1, slots=np.arange(2, dtype=np.int32),
                starts=np.full(2, start, np.int32), lengths=np.ones(2, np.int32),
                temperature=np.zeros(2, np.float32), u=np.full(2, 0.3, np.float32))


def test_a_worker_on_cpu_runs_the_step_after_the_reserve_in_turn(tiny_model, monkeypatch):
    """On cpu no step launches (no graphs): the reserve asks, nothing is launched beside, the step after
    it runs in turn and takes its ids from the step before."""
    monkeypatch.setenv("MOEBUS_HANDBACK_BESIDE_STEP", "1")
    stage = LocalModel(tiny_model, device="cpu", num_slots=2, max_context=32, cache_fraction=0.5,
                       elastic=True).stages[0]
    link = InboxLink()
    worker = GpuWorker(stage, link, gpu=0)
    assert worker.handback_beside
    prompt = Step(step_id=1, slots=np.arange(2, dtype=np.int32), starts=np.zeros(2, np.int32),
                  lengths=np.full(2, 3, np.int32), tokens=np.array([5, 17, 99, 6, 17, 99], np.int32),
                  temperature=np.zeros(2, np.float32), u=np.full(2, 0.3, np.float32))
    worker.handle(prompt)
    worker.handle(decode_step(2, 3))
    link.inbox.put(decode_step(3, 4))  # queued behind the reserve, as the broker sends it
    asked = []
    stage.experts.arena.memory_info = lambda: (0, 1 << 34)  # the emulated GPU's figure: nothing free
    real_resize = stage.experts.resize

    def resize(reserve, query=False, beside=None):
        asked.append(beside)
        return real_resize(reserve, query=query, beside=beside)

    monkeypatch.setattr(stage.experts, "resize", resize)
    reply = worker.handle(Vram(id="~resize-1", reserve_mib=1.0))
    assert reply.error is None and asked and asked[0] is not None  # the next step was offered
    assert not worker.ahead and worker.steps_launched_beside == 0  # and not launched: no graphs on cpu
    out = worker.handle(link.inbox.get())
    assert out.tokens is not None and len(out.tokens) == 2
