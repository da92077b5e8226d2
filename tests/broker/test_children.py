"""The broker's children as real processes: a child that cannot start leaves its reason in its
error file (read once it is seen dead); one that was ready and then died is a crash to restart."""
from __future__ import annotations

import sys
import time

from moebus.broker.children import START_ERROR_ENV, Child

SAYS_WHY = f"import os, sys; open(os.environ['{START_ERROR_ENV}'], 'w').write('tensor x has dtype F8_E4M3'); sys.exit(2)"


def _wait_exit(child: Child) -> int:
    deadline = time.monotonic() + 30
    while (status := child.exited()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return status


def test_a_child_that_cannot_start_says_why(tmp_path):
    child = Child("gpu0 worker", [sys.executable, "-c", SAYS_WHY], error_file=tmp_path / "gpu0.start-error")
    child.start()
    assert _wait_exit(child) == 2
    assert child.start_error == "tensor x has dtype F8_E4M3" and child.quick_exits == 1


def test_a_stale_reason_is_gone_at_the_next_start(tmp_path):
    (tmp_path / "gpu0.start-error").write_text("an earlier life's reason")
    child = Child("gpu0 worker", [sys.executable, "-c", "import sys; sys.exit(1)"],
                  error_file=tmp_path / "gpu0.start-error")
    child.start()
    assert _wait_exit(child) == 1
    assert child.start_error is None and child.quick_exits == 1


def test_an_exit_after_ready_is_a_crash_not_a_start_error(tmp_path):
    child = Child("gpu0 worker", [sys.executable, "-c", f"import time; time.sleep(0.3); {SAYS_WHY}"],
                  error_file=tmp_path / "gpu0.start-error")
    child.start()
    child.mark_ready()
    assert _wait_exit(child) == 2
    assert child.start_error is None and child.quick_exits == 0
