"""MOEBUS_VISION_WARM_UP=beside (workers/vision_worker.WarmUpBeside): the warm-up runs once on its own
thread, ``wait`` joins it, and a failed warm-up is logged, not raised (the encode that follows raises
what it raises). The cpu device: no context to make."""
import logging
import sys
import threading

from moebus.workers.vision_worker import WarmUpBeside


class _Model:
    def __init__(self, error=None):
        self.calls, self.threads, self.error = [], [], error
        self.release = threading.Event()

    def warm_up(self, processor):
        self.threads.append(threading.current_thread().name)
        self.release.wait(5)
        self.calls.append(processor)
        if self.error is not None:
            raise self.error


def test_the_warm_up_runs_once_on_its_thread_and_wait_joins_it():
    model, switch_s = _Model(), sys.getswitchinterval()
    beside = WarmUpBeside(model, "processor", "cpu")
    assert model.calls == []  # still running: the caller went on
    assert sys.getswitchinterval() <= WarmUpBeside.SWITCH_S  # (the main thread's decode waits less for the GIL)
    model.release.set()
    assert beside.wait() >= 0.0
    assert sys.getswitchinterval() == switch_s
    assert model.calls == ["processor"] and model.threads == ["vision-warm-up"]
    assert beside.seconds is not None and beside.seconds >= 0.0


def test_a_failed_warm_up_is_logged_not_raised(caplog):
    model = _Model(error=RuntimeError("no kernel"))
    model.release.set()
    with caplog.at_level(logging.WARNING, logger="moebus.vision"):
        WarmUpBeside(model, None, "cpu").wait()
    assert "the vision warm-up beside failed (RuntimeError: no kernel)" in caplog.text
