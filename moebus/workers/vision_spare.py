"""The vision zygote's spare worker (on by default; ``MOEBUS_VISION_PREFORK=0`` turns it off: a fresh
fork each start). A child forked ahead, for the GPU of the last start (gpu 0 at boot), opens the
driver (cuInit), numba's device and NVML, then blocks on a pipe: it holds nothing on the device (no
context), so no cache has to make room for it. A start writes the zygote's time.time() into that pipe
instead of forking (vision_worker.run_vision_worker's ``go``); a start on another GPU drops the spare
and forks as before. Once the started worker has exited the zygote forks the next spare. A spare that
dies before its start turns spares off for the zygote's life (a fresh fork each start, as without).
A spare names itself ``vision-spare`` (its /proc comm, what ps shows) until its start, so that it can
be told apart from a started worker; it dies with the zygote (parent-death signal), as a worker does."""
from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger("moebus.vision")
PREFORK = os.environ.get("MOEBUS_VISION_PREFORK", "1") != "0"
SPARE_NAME = "vision-spare"  # a spare's /proc/<pid>/comm until its start
PR_SET_NAME = 15


class SpareMixin:
    """The zygote's spare (vision_zygote.Zygote): ``spare`` is (pid, its go pipe's write end, its
    reason pipe's read end, gpu) or None; the zygote provides ``_fork_child``, ``_read_reason``,
    ``stopping``, ``forked_at``."""

    spare: tuple[int, int, int, int] | None = None
    prefork = PREFORK  # off for good once a spare failed

    def _fork_spare(self, gpu: int) -> None:
        """A spare child for ``gpu``, where spares are on and none waits."""
        if not self.prefork or self.spare is not None or self.stopping:
            return
        go_read, go_write = os.pipe()
        pid, read_fd = self._fork_child(gpu, (go_read, go_write))
        os.close(go_read)
        self.spare = (pid, go_write, read_fd, gpu)
        log.info("spare vision worker %d forked for gpu%d", pid, gpu)

    def _wake_spare(self, gpu: int) -> tuple[int, int] | None:
        """(pid, the read end of its reason pipe) of the spare for ``gpu``, told to start now; None
        where there is none (or it has died since the last reap: then dropped)."""
        if self.spare is None or self.spare[3] != gpu:
            return None
        pid, go_fd, read_fd, _ = self.spare
        self.forked_at = time.time()
        try:
            os.write(go_fd, repr(self.forked_at).encode())
        except OSError:
            return None  # (the caller drops it)
        os.close(go_fd)
        self.spare = None
        return pid, read_fd

    def _drop_spare(self) -> None:
        if self.spare is None:
            return
        pid, go_fd, read_fd, _ = self.spare
        self.spare = None
        os.close(go_fd)  # (its wait_go reads the end and returns; the kill makes sure)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(read_fd)

    def _reap_spare(self) -> None:
        """A spare that has exited before its start: reported, and no more spares."""
        if self.spare is None or os.waitpid(self.spare[0], os.WNOHANG)[0] == 0:
            return
        pid, go_fd, reason_fd, _ = self.spare
        log.warning("spare vision worker %d exited before its start (%s); no more spares",
                    pid, self._read_reason(reason_fd) or "no reason given")
        os.close(go_fd)
        self.spare, self.prefork = None, False


def wait_go(fd: int) -> float | None:
    """A spare's wait for its start: the zygote's time.time() then, or None when the pipe closed."""
    data = b""
    while True:
        chunk = os.read(fd, 64)
        if not chunk:
            break
        data += chunk
    os.close(fd)
    return float(data) if data else None


def name_process(name: str) -> str:
    """Set this process's comm (prctl PR_SET_NAME, at most 15 bytes); returns the name it had ("" where
    /proc or prctl are missing: nothing is changed then)."""
    import ctypes

    try:
        with open("/proc/self/comm") as comm:
            old = comm.read().strip()
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except OSError:
        return ""
    return old


def spare_go(fd: int):
    """A spare's ``go`` for vision_worker.run_vision_worker: named ``vision-spare`` now, its own name
    again once started (or dropped)."""
    old = name_process(SPARE_NAME)

    def go() -> float | None:
        try:
            return wait_go(fd)
        finally:
            if old:
                name_process(old)
    return go
