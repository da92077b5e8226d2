"""The vision hand-back in steps (broker/vision_handback.py): evenly growing reserves from what each
GPU has free, the next request once a decode step has been sent after the last one (or none is
running, or the pause ran out), the last reply handed on, an error ending it early. The regrow after a stop
goes down the same way to a bare VRAM. The broker's VRAM fan-out is played by a queue here."""
from __future__ import annotations

from types import SimpleNamespace

from moebus.broker.vision_handback import MAX_PAUSE_S, Handback, handback_plan, regrow_plan


def test_the_plan_grows_evenly_to_the_reserves():
    assert handback_plan([1800.0, 600.0], 256) == [[1800 * i / 8, 600 * i / 8] for i in range(1, 9)]
    assert handback_plan([17.0, 0.0], 256) == [[17.0, 0.0]]  # the cpu demo: one request
    assert handback_plan([1700.0, None], 1000) == [[850.0, None], [1700.0, None]]
    assert handback_plan([None, None], 256) == [[None, None]]


def test_the_plan_starts_from_what_is_free():
    # gap6's hand-back: 278 MiB free, 1800 asked in 64 MiB steps took 29 requests, the first three
    # asking for room that was there; from the free MiB, 24 each free a step
    plan = handback_plan([1800.0], 64, [278.0])
    assert len(plan) == 24 and plan[0] == [278.0 + (1800 - 278) / 24] and plan[-1] == [1800.0]
    assert handback_plan([1800.0, 500.0], 256, [1700.0, 0.0]) == [[1750.0, 250.0], [1800.0, 500.0]]
    assert handback_plan([500.0], 256, [900.0]) == [[500.0]]  # already free: one request, nothing to shrink
    assert handback_plan([1700.0, None], 1000, [None, 5.0]) == [[850.0, None], [1700.0, None]]  # None: nothing known


class Broker:
    """What the Handback asks of the broker: its VRAM queue, its count of steps sent, whether it decodes."""

    def __init__(self):
        self.queued, self.sent, self.running, self.done, self.interim = [], 0, True, [], []

    def queue_vram(self, reserves, on_reply, interim=False, between_steps=False):
        assert between_steps  # every request goes out without draining the steps in flight
        self.queued.append((reserves, on_reply))
        self.interim.append(interim)

    def answer(self, error=None):
        reserves, on_reply = self.queued[-1]
        on_reply(SimpleNamespace(error=error, reserve_mib=reserves))


def handback(broker, reserves=(1024.0, 512.0), free=None):
    h = Handback(list(reserves), 256, broker.queue_vram, lambda: broker.sent, lambda: broker.running,
                 broker.done.append, free)
    h.start()
    return h


def test_a_step_sent_after_a_request_lets_the_next_one_go():
    broker = Broker()
    h = handback(broker)
    assert [r for r, _ in broker.queued] == [[256.0, 128.0]]
    broker.answer()  # no step sent since the request: the next one waits (two resizes would meet)
    h.tick(0.0)
    assert len(broker.queued) == 1
    broker.sent += 1  # a step goes out behind the request: it will run between the two resizes
    h.tick(0.0)
    assert [r for r, _ in broker.queued][-1] == [512.0, 256.0]
    for _ in range(2):  # the usual order: the look-ahead step is out before the reply comes,
        broker.sent += 1  # so the next request goes with the reply
        broker.answer()
    assert broker.done == [] and [r for r, _ in broker.queued][-1] == [1024.0, 512.0]
    broker.answer()
    assert [reply.reserve_mib for reply in broker.done] == [[1024.0, 512.0]]
    assert broker.interim == [True, True, True, False]  # only after the last does the broker ask INFO


def test_the_free_mib_shorten_the_plan():
    broker = Broker()
    h = handback(broker, free=[600.0, 0.0])
    assert h.plan == [[812.0, 256.0], [1024.0, 512.0]]


def test_with_nothing_decoding_as_it_begins_it_is_one_request():
    broker = Broker()
    broker.running = False
    h = handback(broker)
    assert h.plan == [[1024.0, 512.0]] and broker.interim == [False]
    broker.answer()
    assert [reply.reserve_mib for reply in broker.done] == [[1024.0, 512.0]]


def test_when_decoding_stops_or_after_the_pause_it_goes_on():
    broker = Broker()
    h = handback(broker)
    broker.running = False  # the text streams ended meanwhile: no step will pass
    broker.answer()
    h.tick(0.0)
    assert len(broker.queued) == 2
    broker.running = True
    broker.answer()
    h.tick(0.0)
    assert len(broker.queued) == 2  # no step sent since: it waits
    h.tick(1e9)  # a stalled pipeline does not hold the start for ever
    assert len(broker.queued) == 3 and MAX_PAUSE_S < 1


def test_an_error_ends_it_early():
    broker = Broker()
    handback(broker)
    broker.answer(error="gpu0: not elastic")
    assert len(broker.done) == 1 and broker.done[0].error == "gpu0: not elastic" and len(broker.queued) == 1


def test_the_regrow_falls_evenly_to_a_bare_vram():
    assert regrow_plan([1024.0, 512.0], 256) == [[768.0, 384.0], [512.0, 256.0], [256.0, 128.0], [None, None]]
    assert regrow_plan([1700.0, None], 1000) == [[850.0, None], [None, None]]  # a GPU not handed back stays bare
    assert regrow_plan([17.0], 256) == [[None]]  # the cpu demo: one request
    assert regrow_plan([None, None], 64) == [[None, None]]


def test_the_regrow_goes_a_step_at_a_time_and_ends_with_the_bare_reply():
    broker = Broker()
    plan = regrow_plan([1024.0, 512.0], 256)
    h = Handback([1024.0, 512.0], 256, broker.queue_vram, lambda: broker.sent, lambda: broker.running,
                 broker.done.append, plan=plan)
    h.start()
    for i in range(3):
        assert [r for r, _ in broker.queued][-1] == plan[i]
        broker.sent += 1  # a decode step runs between two resizes
        broker.answer()
    assert broker.done == [] and [r for r, _ in broker.queued][-1] == [None, None]
    broker.answer()
    assert [reply.reserve_mib for reply in broker.done] == [[None, None]]
    assert broker.interim == [True, True, True, False]


def test_with_nothing_decoding_the_regrow_is_one_bare_request():
    broker = Broker()
    broker.running = False
    Handback([1024.0], 256, broker.queue_vram, lambda: broker.sent, lambda: broker.running, broker.done.append,
             plan=regrow_plan([1024.0], 256)).start()
    assert [r for r, _ in broker.queued] == [[None]] and broker.interim == [False]
