"""The in-flight bookkeeping of pipelined steps: which stage has which step, a step that waits for a
busy stage, the order waiting steps go on in, deadlines only while a stage has a step."""
import numpy as np

from moebus.broker.inflight import Inflight
from moebus.broker.scheduler import Scheduler
from moebus.broker.sequence import Sequence
from moebus.common.protocol import Sampling


def plan_of(*ids):
    scheduler = Scheduler(max_batch=8, max_queue=8, max_step_tokens=64)
    for i in ids:
        scheduler.submit(Sequence(id=i, client=b"c", prompt=[1, 2], sampling=Sampling(), decoder=None,
                                  stop_ids=frozenset(), max_context=64))
    return scheduler.plan()


def test_unpipelined_keeps_one_step_in_flight():
    table = Inflight(num_stages=2, pipeline=False)
    assert table.num_groups == 1 and table.can_start()
    table.start(1, plan_of("a"), now=0.0)
    assert not table.can_start()


def test_one_stage_is_never_pipelined():
    table = Inflight(num_stages=1, pipeline=True)
    assert not table.is_pipelined and table.num_groups == 1


def test_a_step_waits_for_a_busy_stage_then_goes_on_in_start_order():
    table = Inflight(num_stages=2, pipeline=True)
    a = table.start(1, plan_of("a"), now=0.0)
    assert not table.can_start()  # stage 0 has a
    table.park(a, np.zeros(1))
    assert table.next_ready() is a and a.stage == 1 and not a.waiting
    assert table.can_start() and table.at_stage(1) is a
    b = table.start(2, plan_of("b"), now=0.0)
    assert not table.can_start()  # one step per stage: two in flight
    assert table.busy_ids() == {"a", "b"}
    table.park(b, np.ones(1))
    assert table.next_ready() is None and b.waiting  # stage 1 still has a
    assert table.answered(1, 2) is None and table.answered(1, 1) is a  # b's stage-0 reply is not stage 1's
    table.discard(a)
    assert table.next_ready() is b and b.stage == 1 and b.hidden[0] == 1
    assert table.discard(a) == []  # already out


def test_deadlines_run_only_while_a_stage_has_the_step():
    table = Inflight(num_stages=2, pipeline=True)
    a = table.start(1, plan_of("a"), now=0.0)
    a.sent_s = 0.0
    b = table.start(2, plan_of("b"), now=0.0)
    b.stage, b.sent_s = 1, 0.0
    table.park(b, np.zeros(1))
    assert table.overdue(now=10.0, timeout_s=5.0) == [a]
    table.forgive(now=10.0)
    assert table.overdue(now=12.0, timeout_s=5.0) == []
    assert len(table.clear()) == 2 and not table


def test_the_scheduler_splits_the_running_sequences_into_groups():
    scheduler = Scheduler(max_batch=8, max_queue=8, max_step_tokens=64)
    for i in range(5):
        scheduler.submit(Sequence(id=str(i), client=b"c", prompt=[1, 2, 3], sampling=Sampling(), decoder=None,
                                  stop_ids=frozenset(), max_context=64))
    first = scheduler.plan(num_groups=2)
    second = scheduler.plan(busy={s.id for s in first.seqs}, num_groups=2)
    assert [s.id for s in first.seqs] == ["0", "1", "2"] and [s.id for s in second.seqs] == ["3", "4"]
    assert scheduler.plan(busy={str(i) for i in range(5)}, num_groups=2) is None
