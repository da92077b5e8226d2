"""Child processes of the broker (GPU workers, the api server): started with the parent-death signal
set, so that no child outlives a SIGKILLed parent, restarted with back-off when they die.

A child that cannot start (a setting or a checkpoint it refuses) says why in the file named by
``$MOEBUS_START_ERROR_FILE`` before it exits (cli.py writes it); the broker reads it as the child's
``start_error`` and ends the whole start, instead of restarting a child that can never be ready."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from moebus.common.parent_death import signal_on_parent_death

log = logging.getLogger("moebus.broker")
START_ERROR_ENV = "MOEBUS_START_ERROR_FILE"
MAX_START_ERROR_BYTES = 8192


def die_with_parent() -> None:  # runs in the child between fork and exec
    signal_on_parent_death(signal.SIGTERM)
    os.setpgrp()  # a Ctrl-C in the terminal reaches the parent only; the parent stops the children


class Child:
    def __init__(self, name: str, argv: list[str], env: dict | None = None, restart: bool = True,
                 error_file: Path | None = None):
        """``error_file``: where the child writes why it could not start (None: not asked)."""
        self.name = name
        self.argv = argv
        self.env = env
        self.restart = restart
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0
        self.next_start_s = 0.0
        self.backoff_s = 0.5
        self.restarts = 0
        self.quick_exits = 0  # exits within 30 s of their start, in a row, none of them after being ready
        self.error_file = error_file
        self.is_ready = False  # this life of the child has said it serves (a worker's READY)
        self.start_error: str | None = None  # why the last life could not start, from its error file

    def start(self) -> None:
        env = dict(os.environ, **(self.env or {}))
        if self.error_file is not None:
            self.error_file.unlink(missing_ok=True)
            env[START_ERROR_ENV] = str(self.error_file)
        self.is_ready, self.start_error = False, None
        self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=die_with_parent)
        self.started_s = time.monotonic()
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> int | None:
        """The exit status once, the first time the process is seen dead; else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        status, self.proc = self.proc.returncode, None
        if not self.is_ready:
            self.start_error = self._read_start_error()
        quick = time.monotonic() - self.started_s < 30
        self.quick_exits = self.quick_exits + 1 if quick and not self.is_ready else 0
        self.backoff_s = min(self.backoff_s * 2, 10.0) if quick else 0.5
        self.next_start_s = time.monotonic() + self.backoff_s
        return status

    def mark_ready(self) -> None:
        """This life got as far as serving: an exit from now on is a crash to restart, not a start
        that cannot succeed."""
        self.is_ready, self.quick_exits = True, 0

    def _read_start_error(self) -> str | None:
        if self.error_file is None or not self.error_file.is_file():
            return None
        with open(self.error_file, "rb") as f:
            text = f.read(MAX_START_ERROR_BYTES).decode(errors="replace").strip()
        return text or None

    def maybe_restart(self) -> bool:
        if self.restart and self.proc is None and time.monotonic() >= self.next_start_s:
            self.restarts += 1
            self.start()
            return True
        return False

    def kill(self) -> None:
        if self.is_running():
            self.proc.kill()

    def stop(self, timeout_s: float = 5.0) -> None:
        if not self.is_running():
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def python_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "moebus.cli", *args]
