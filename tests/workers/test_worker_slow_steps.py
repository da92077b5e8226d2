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
