"""workers/link.py's MOEBUS_LOG_DECODE_MS: a message the link's thread took long to decode is logged with its size."""
import logging
from types import SimpleNamespace

import numpy as np

from moebus.common import wire
from moebus.common.protocol import Step
from moebus.workers import link as link_module
from moebus.workers.link import BrokerLink


def test_a_long_decode_is_logged_with_its_size(monkeypatch, caplog):
    monkeypatch.setattr(link_module, "LOG_DECODE_MS", 1e-9)  # every decode is "long"
    link = BrokerLink("tcp://127.0.0.1:5999", "gpu0")
    try:
        step = Step(step_id=3, slots=np.zeros(1, np.int32), starts=np.zeros(1, np.int32), lengths=np.full(1, 4, np.int32),
                    tokens=np.arange(4, dtype=np.int32), embeds=np.zeros((2, 256), np.float32),
                    embed_rows=np.array([1, 2], np.int32))
        frames = [SimpleNamespace(buffer=memoryview(bytes(f))) for f in wire.encode(step)]
        with caplog.at_level(logging.INFO, logger="moebus.worker"):
            link._deliver(None, frames)
        assert link.recv(timeout_s=1.0).step_id == 3
        (line,) = [r.getMessage() for r in caplog.records if "decoded in" in r.getMessage()]
        assert line.startswith("gpu0: Step of 0.00 MB decoded in ")  # 2 KB of image rows
    finally:
        link._pipe.close()
