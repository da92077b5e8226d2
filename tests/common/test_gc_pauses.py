"""A garbage collection longer than MOEBUS_LOG_GC_MS is logged with its generation (where a text
stream's gap that no step explains came from); off by default."""
import gc
import logging

from moebus.common.gc_pauses import log_long_collections


def test_a_long_collection_is_logged_and_none_when_off(caplog, monkeypatch):
    monkeypatch.delenv("MOEBUS_LOG_GC_MS", raising=False)
    log = logging.getLogger("moebus.test_gc")
    before = list(gc.callbacks)
    try:
        assert not log_long_collections(log, "gpu0")  # off: nothing installed
        assert gc.callbacks == before
        assert log_long_collections(log, "gpu0", threshold_ms=1e-6)  # any collection is longer than this
        with caplog.at_level(logging.INFO, logger="moebus.test_gc"):
            gc.collect(2)
        lines = [r.getMessage() for r in caplog.records]
        assert lines and lines[-1].startswith("gpu0: a garbage collection of generation 2 took "), lines
    finally:
        gc.callbacks[:] = before


def test_freeze_moves_what_the_process_holds_out_of_the_collector_s_walks(caplog, monkeypatch):
    from moebus.common.gc_pauses import watch

    monkeypatch.delenv("MOEBUS_LOG_GC_MS", raising=False)
    log = logging.getLogger("moebus.test_gc")
    monkeypatch.setenv("MOEBUS_GC_FREEZE", "0")
    watch(log, "broker")
    assert gc.get_freeze_count() == 0  # 0: off
    monkeypatch.delenv("MOEBUS_GC_FREEZE")  # on by default
    try:
        with caplog.at_level(logging.INFO, logger="moebus.test_gc"):
            watch(log, "broker")
        assert gc.get_freeze_count() > 0
        assert caplog.records[-1].getMessage().startswith("broker: ") and "frozen" in caplog.records[-1].getMessage()
    finally:
        gc.unfreeze()
