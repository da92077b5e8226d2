"""The broker's VRAM bookkeeping: queries go out at once, resizes wait their turn in a bounded queue,
a silent worker is found at the deadline, a dead one owes nothing, a new worker gets its GPU's reserve."""
import pytest

from moebus.broker.vram_control import VramControl
from moebus.common.errors import ServerBusy
from moebus.common.protocol import Error, VramReply


class Wire:
    """Collects what the control sends (it is given plain callables by the broker)."""

    def __init__(self, reachable=(0, 1)):
        self.to_workers, self.to_clients, self.reachable = [], [], set(reachable)

    def worker(self, gpu, message):
        self.to_workers.append((gpu, message))
        return gpu in self.reachable

    def client(self, client, message):
        self.to_clients.append((client, message))


def reply(msg, reserve=0.0):
    return VramReply(id=msg.id, reserve_mib=reserve, free_mib=10, expert_slots=4, expert_cache_mib=8)


def control(wire, timeout_s=1.0, max_queue=2):
    return VramControl(2, wire.worker, wire.client, max_queue=max_queue, timeout_s=timeout_s)


def test_a_query_goes_out_at_once_and_a_resize_waits_for_a_gap_between_steps():
    wire = Wire()
    vc = control(wire)
    vc.request(b"c", [None, None], query=True, request_id="q")
    assert [m.query for _, m in wire.to_workers] == [True, True] and vc.inflight is None
    vc.request(b"c", [8.0, None], query=False, request_id="r")
    assert len(wire.to_workers) == 2  # not yet: the broker starts it between two steps
    assert vc.start_next()
    for gpu, msg in wire.to_workers[2:]:
        vc.on_reply(gpu, reply(msg, msg.reserve_mib or 0))
    assert vc.inflight is None and vc.reserves == [8.0, None]
    for gpu, msg in wire.to_workers[:2]:
        vc.on_reply(gpu, reply(msg))
    assert [m.id for _, m in wire.to_clients] == ["r", "q"]


def test_the_queue_is_bounded():
    vc = control(Wire(), max_queue=2)
    for _ in range(2):
        vc.request(b"c", [1.0, 1.0], query=False, request_id=None)
    with pytest.raises(ServerBusy):
        vc.request(b"c", [1.0, 1.0], query=False, request_id=None)


def test_a_silent_worker_is_found_at_the_deadline_and_the_client_answered():
    wire = Wire()
    vc = control(wire, timeout_s=1.0)
    vc.request(b"c", [4.0, 4.0], query=False, request_id="r")
    vc.start_next()
    gpu, msg = wire.to_workers[0]
    vc.on_reply(gpu, reply(msg, 4.0))
    fanout = vc.inflight
    assert vc.overdue(fanout.started_s + 0.5) == []
    assert vc.overdue(fanout.started_s + 1.5) == [1]
    vc.on_lost(1, "gpu1 missed its deadline")  # what the broker does after killing it
    (client, answer), = wire.to_clients
    assert vc.inflight is None and answer.id == "r" and "gpu1" in answer.error  # one GPU answered: a reply


def test_an_unreachable_worker_fails_its_entry_at_once():
    wire = Wire(reachable=())
    vc = control(wire)
    vc.request(b"c", [None, None], query=True, request_id="q")
    (_, answer), = wire.to_clients
    assert isinstance(answer, Error) and answer.id == "q"


def test_a_new_worker_gets_its_gpus_reserve_back():
    wire = Wire()
    vc = control(wire)
    assert not vc.restore(0)  # never resized: the start-up reserve is what it has
    vc.reserves[1] = 6.0
    assert vc.restore(1)
    gpu, msg = wire.to_workers[-1]
    assert gpu == 1 and msg.reserve_mib == 6.0 and not msg.query
    assert vc.on_reply(1, reply(msg, 6.0)) and vc.restoring == {}


def test_the_broker_s_interim_steps_are_observed_as_interim():
    """A stepped hand-back's requests are observed with ``interim`` (the broker then asks no worker
    for INFO, which would sit ahead of the next decode step) until the request that ends it."""
    wire, seen, done = Wire(), [], []
    vc = VramControl(2, wire.worker, wire.client, max_queue=2, timeout_s=1.0,
                     observe=lambda reserves, answer, query, interim: seen.append((reserves, interim)))
    for reserves, interim in (([4.0, 2.0], True), ([8.0, 4.0], False)):
        vc.internal(reserves, done.append, interim=interim)
        assert vc.start_next()
        for gpu, msg in wire.to_workers[-2:]:
            vc.on_reply(gpu, reply(msg, msg.reserve_mib))
    assert seen == [([4.0, 2.0], True), ([8.0, 4.0], False)] and len(done) == 2 and vc.reserves == [8.0, 4.0] and wire.to_clients == []


def test_a_between_steps_resize_goes_out_at_once_and_holds_no_step():
    """The hand-back's requests are sent with steps in flight and let new steps go; a client's
    resize still waits for an empty pipeline and holds steps until it is answered."""
    wire, done = Wire(), []
    vc = control(wire)
    vc.internal([4.0, 2.0], done.append, between_steps=True)
    assert not vc.steps_wait(pipeline_empty=False) and len(wire.to_workers) == 2  # sent, steps go on
    vc.request(b"c", [8.0, None], query=False, request_id="r")
    assert not vc.steps_wait(pipeline_empty=False) and len(wire.to_workers) == 2  # the client's waits its turn
    for gpu, msg in wire.to_workers:
        vc.on_reply(gpu, reply(msg, msg.reserve_mib))
    assert len(done) == 1
    assert vc.steps_wait(pipeline_empty=False) and len(wire.to_workers) == 2  # holds steps, not sent yet
    assert vc.steps_wait(pipeline_empty=True) and len(wire.to_workers) == 4  # sent once the pipeline is empty
    for gpu, msg in wire.to_workers[2:]:
        vc.on_reply(gpu, reply(msg, msg.reserve_mib or 0))
    assert not vc.steps_wait(pipeline_empty=False) and [m.id for _, m in wire.to_clients] == ["r"]
