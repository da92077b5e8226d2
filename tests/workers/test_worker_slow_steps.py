"""A GPU worker logs a decode step far slower than its recent ones (where a text stream's gap came
from, e.g. a vision worker starting on the same GPU), and nothing for steps of the usual time."""
import logging

from moebus.workers.gpu_worker import GpuWorker


def test_only_a_step_far_above_the_recent_median_is_logged(caplog):
    worker = GpuWorker(stage=None, link=None, gpu=0)
    with caplog.at_level(logging.INFO, logger="moebus.worker"):
        for i in range(7):
            worker.note_decode(i, 2, 0.5)  # fewer than 8 known: no median to compare with yet
        for i in range(7, 20):
            worker.note_decode(i, 2, 0.008 if i != 15 else 0.015)  # 1.9x: within the factor
        worker.note_decode(20, 2, 0.085)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["gpu0: decode step 20 took 85.0 ms (batch 2; median of the last 20: 8.0 ms)"], lines


def test_a_slow_info_and_a_step_long_after_the_last_are_logged(caplog, monkeypatch):
    """Where a gap is not a slow step: an INFO served between two steps (it holds the next one; its
    driver call named), or the worker without a step (the broker's time). Short ones are not logged."""
    from moebus.workers import gpu_worker

    worker = GpuWorker(stage=None, link=None, gpu=0)
    worker.driver_info_s = 0.0184
    clock = iter([1.0, 1.002, 2.0, 2.021])  # two INFOs: 2 ms, then 21 ms
    monkeypatch.setattr(gpu_worker.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(worker, "stats", lambda: {})
    with caplog.at_level(logging.INFO, logger="moebus.worker"):
        worker.info()
        worker.info()
        assert worker.note_idle(7, 5.0) is None  # the first step: nothing before it
        worker.last_step_end_s = 5.0
        assert round(worker.note_idle(8, 5.004), 6) == 0.004
        worker.last_step_end_s = 6.0
        worker.note_idle(9, 6.0255)
        worker.note_idle(10, 9.0)  # a worker idle between requests: not a gap of a stream
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["gpu0: INFO took 21.0 ms (the driver's free memory 18.4 ms)",
                     "gpu0: step 9 came 25.5 ms after the last one ended"], lines
