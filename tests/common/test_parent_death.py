"""common/parent_death.py: a child that asked for the parent-death signal ends when its parent is SIGKILLed;
one that did not ask outlives it (the control)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from moebus.common.parent_death import signal_on_parent_death

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
PARENT = """
import os, sys, time
from moebus.common.parent_death import signal_on_parent_death
pid = os.fork()
if pid == 0:
    if sys.argv[2] == "ask":
        assert signal_on_parent_death()
    open(sys.argv[1] + ".part", "w").write(str(os.getpid()))
    os.rename(sys.argv[1] + ".part", sys.argv[1])  # whole when it appears
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def _child_of_a_killed_parent(tmp_path, ask: str) -> int:
    pid_file = tmp_path / f"child-{ask}"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file), ask])
    deadline = time.monotonic() + 30
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the child never wrote its pid"
        time.sleep(0.02)
    child = int(pid_file.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    return child


def test_a_child_that_asked_ends_with_its_killed_parent_and_one_that_did_not_outlives_it(tmp_path):
    asked = _child_of_a_killed_parent(tmp_path, "ask")
    control = _child_of_a_killed_parent(tmp_path, "no")
    try:
        deadline = time.monotonic() + 10
        while _alive(asked) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(asked)
        assert _alive(control)
    finally:
        for pid in (asked, control):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_it_says_whether_it_was_set():
    assert signal_on_parent_death(signal.SIGTERM) is True  # this test process: its parent is pytest's runner
    signal_on_parent_death(0)  # 0 clears it again
