"""The vision zygote's spare (workers/vision_spare.py) with real forked children that only wait for their go
(the whole path, a served cold start from a spare: tests/e2e/test_vision_prefork.py)."""
import os
import time

from moebus.workers.vision_spare import SpareMixin, wait_go
from moebus.workers.vision_zygote import Zygote


class Spares(SpareMixin):
    """A zygote's spare bookkeeping; each child exits 0 when started, 5 when dropped, 4 at once with ``die``."""

    _read_reason = staticmethod(Zygote._read_reason)

    def __init__(self, die: bool = False):
        self.stopping, self.forked_at, self.die, self.prefork = False, None, die, True

    def _fork_child(self, gpu, go=None):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            os.close(go[1])
            if self.die:
                os.write(write_fd, b"no driver")
                os._exit(4)
            os._exit(0 if wait_go(go[0]) is not None else 5)
        os.close(write_fd)
        return pid, read_fd


def _exit_code(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_woken_spare_gets_its_start_time_and_the_next_is_forked_anew():
    spares = Spares()
    spares._fork_spare(0)
    pid = spares.spare[0]
    spares._fork_spare(0)  # one at a time
    assert spares.spare[0] == pid
    assert spares._wake_spare(1) is None and spares.spare[0] == pid  # another GPU's start: not this one
    woken, reason_fd = spares._wake_spare(0)
    assert woken == pid and spares.spare is None and spares.forked_at <= time.time()
    assert _exit_code(pid) == 0
    os.close(reason_fd)
    spares._fork_spare(0)
    assert spares.spare[0] != pid
    spares._drop_spare()
    assert spares.spare is None


def test_a_dropped_spare_is_gone():
    spares = Spares()
    spares._fork_spare(1)
    pid = spares.spare[0]
    spares._drop_spare()
    assert spares.spare is None and not os.path.exists(f"/proc/{pid}")


def test_a_spare_that_dies_turns_spares_off():
    spares = Spares(die=True)
    spares._fork_spare(0)
    pid = spares.spare[0]
    deadline = time.monotonic() + 10
    while spares.spare is not None and time.monotonic() < deadline:
        spares._reap_spare()
        time.sleep(0.01)
    assert spares.spare is None and not spares.prefork and not os.path.exists(f"/proc/{pid}")
    spares._fork_spare(0)
    assert spares.spare is None and spares._wake_spare(0) is None


def test_wait_go_reads_the_start_time_or_the_pipe_closed():
    read_fd, write_fd = os.pipe()
    os.write(write_fd, repr(1234.5).encode())
    os.close(write_fd)
    assert wait_go(read_fd) == 1234.5
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    assert wait_go(read_fd) is None
