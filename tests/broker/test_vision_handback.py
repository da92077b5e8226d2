"""The vision hand-back in steps (broker/vision_handback.py): evenly growing reserves, the next
request only after a decode step has passed (or none is running, or the pause ran out), the last
reply handed on, an error ending it early. The broker's VRAM fan-out is played by a queue here."""
from __future__ import annotations

from types import SimpleNamespace

from moebus.broker.vision_handback import MAX_PAUSE_S, Handback, handback_plan


def test_the_plan_grows_evenly_to_the_reserves():
    assert handback_plan([1800.0, 600.0], 256) == [[1800 * i / 8, 600 * i / 8] for i in range(1, 9)]
    assert handback_plan([17.0, 0.0], 256) == [[17.0, 0.0]]  # the cpu demo: one request
    assert handback_plan([1700.0, None], 1000) == [[850.0, None], [1700.0, None]]
    assert handback_plan([None, None], 256) == [[None, None]]


class Broker:
    """What the Handback asks of the broker: its VRAM queue, its step count, whether it decodes."""

    def __init__(self):
        self.queued, self.steps, self.running, self.done, self.interim = [], 0, True, [], []

    def queue_vram(self, reserves, on_reply, interim=False, between_steps=False):
        assert between_steps  # every request goes out without draining the steps in flight
        self.queued.append((reserves, on_reply))
        self.interim.append(interim)

    def answer(self, error=None):
        reserves, on_reply = self.queued[-1]
        on_reply(SimpleNamespace(error=error, reserve_mib=reserves))


def handback(broker, reserves=(1024.0, 512.0)):
    h = Handback(list(reserves), 256, broker.queue_vram, lambda: broker.steps, lambda: broker.running,
                 broker.done.append)
    h.start()
    return h


def test_a_step_passes_between_two_requests():
    broker = Broker()
    h = handback(broker)
    assert [r for r, _ in broker.queued] == [[256.0, 128.0]]
    broker.answer()
    h.tick(0.0)  # no step yet: the next request waits
    assert len(broker.queued) == 1
    broker.steps += 1
    h.tick(0.0)
    assert [r for r, _ in broker.queued][-1] == [512.0, 256.0]
    for _ in range(2):
        broker.answer()
        broker.steps += 1
        h.tick(0.0)
    assert broker.done == [] and [r for r, _ in broker.queued][-1] == [1024.0, 512.0]
    broker.answer()
    assert [reply.reserve_mib for reply in broker.done] == [[1024.0, 512.0]]
    assert broker.interim == [True, True, True, False]  # only after the last does the broker ask INFO


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
    h.tick(1e9)  # a stalled pipeline does not hold the start for ever
    assert len(broker.queued) == 3 and MAX_PAUSE_S < 1


def test_an_error_ends_it_early():
    broker = Broker()
    handback(broker)
    broker.answer(error="gpu0: not elastic")
    assert len(broker.done) == 1 and broker.done[0].error == "gpu0: not elastic" and len(broker.queued) == 1
