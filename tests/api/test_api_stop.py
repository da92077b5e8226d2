"""An api process that was told to stop ends even when a thread of it never returns: the hard stop
after the grace (api/server.py), so that an api whose broker is gone cannot outlive it."""
import subprocess
import sys
import time

SCRIPT = """
import threading, time
from moebus.api.server import _exit_anyway_after
_exit_anyway_after(0.3)
worker = threading.Thread(target=time.sleep, args=(60,))  # non-daemon: a normal exit would wait for it
worker.start()
worker.join()
"""


def test_a_stop_that_cannot_finish_ends_the_process_anyway():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert time.monotonic() - started < 15
    assert "did not stop within 0.3 s" in done.stderr
