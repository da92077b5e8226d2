"""workers/step_watch.py: the slow step's stack samples and the kernels counted by name."""
import logging
import time
from types import SimpleNamespace

from moebus.workers import step_watch


def fake_kernel(name, hits, misses):
    def py_func():
        pass
    py_func.__qualname__ = name
    return SimpleNamespace(py_func=py_func, stats=SimpleNamespace(cache_hits={"sig": hits}, cache_misses={"sig": misses}))


def test_kernel_counts_by_name_and_what_grew():
    kernels = [fake_kernel("a", 1, 0), fake_kernel("b", 0, 1), SimpleNamespace()]  # the last has no stats
    then = step_watch.kernel_counts(kernels)
    assert then == {"a": (1, 0), "b": (0, 1)}
    kernels[1].stats.cache_misses["sig2"] = 1
    kernels.append(fake_kernel("c", 1, 0))
    assert step_watch.counts_since(step_watch.kernel_counts(kernels), then) == "b +0/+1, c +1/+0"
    assert step_watch.counts_since(then, then) == ""


def test_slow_step_sampled_and_reported(caplog):
    kernels = [fake_kernel("k", 0, 0)]
    watch = step_watch.StepWatch("gpu0", 0.05, kernels)
    try:
        with caplog.at_level(logging.INFO, logger="moebus.worker"):
            watch.begin(7)
            started = time.perf_counter()
            kernels[0].stats.cache_misses["sig"] = 1  # compiled inside the step
            while time.perf_counter() - started < 0.6:
                time.sleep(0.01)
            watch.end()
    finally:
        watch.close()
    samples = [r.getMessage() for r in caplog.records if "running for" in r.getMessage()]
    assert samples and all(m.startswith("gpu0: step 7 running for") for m in samples)
    assert "test_step_watch.py" in samples[0] and "test_slow_step_sampled_and_reported" in samples[0]
    assert any("step 7 took" in r.getMessage() and "k +0/+1" in r.getMessage() for r in caplog.records)


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("MOEBUS_STEP_STACKS_S", raising=False)
    assert step_watch.from_env("gpu0") is None


def test_frames_innermost_first_then_moebus_own():
    import sys

    from moebus.workers import step_watch as sw

    def inner():
        return sw.frames_of(sys._getframe(), count=1, own=2)
    text = inner()
    assert text.startswith("test_step_watch.py:") and text.split(" < ")[0].endswith(" inner")
    assert " | " not in text or "moebus" not in text.split(" | ")[0]
