"""The service under NVIDIA's Multi-Process Service (MPS): a private control daemon, and the vision
worker's place among its clients.

Without MPS each process on a GPU has its own context and the GPU time-slices between them: while the
vision worker's tower runs, a text step's kernels wait for the tower's slice to end. Under an MPS server
the processes' kernels share the SMs, and a client may ask to be served after the others
(``CUDA_MPS_CLIENT_PRIORITY`` 1, "below normal") or on a share of the SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). The driver reads both when the process makes its context, so
they go into the vision zygote's environment, which each forked vision worker inherits; the text
workers keep the normal priority and every SM. On an H100 (thirty-fourth session) the cold image's
encode phase then gave the text streams a largest gap of 6.8-7.7 ms (nine runs) against 8.4-11.2
time-sliced (four).

``mps: true`` starts ``nvidia-cuda-mps-control -f`` as a child of the broker (it dies with it) with its
pipe and log directories in the run directory: only this service's processes reach it, other programs
on the GPU keep their own contexts (compute mode Default). It starts the MPS server on the first
client; ``quit`` at the broker's end stops both."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from moebus.broker.children import die_with_parent
from moebus.common.errors import ConfigError

log = logging.getLogger("moebus.broker")
CONTROL = "nvidia-cuda-mps-control"
PRIORITIES = {"normal": "0", "below_normal": "1"}


def vision_client_env(vision) -> dict[str, str]:
    """The CUDA_MPS_* variables of the vision worker's process from ``vision`` (VisionSettings): its
    priority under an MPS server and, where set, its share of the SMs. Without a server the driver
    does not read them."""
    env = {"CUDA_MPS_CLIENT_PRIORITY": PRIORITIES[vision.mps_priority]}
    if vision.mps_sm_percent is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(vision.mps_sm_percent)
    return env


class MpsDaemon:
    """One service's MPS control daemon. ``env``: what each worker's environment gets to be its client."""

    def __init__(self, run_dir: Path, binary: str):
        """``binary``: the control program (find_binary's)."""
        self.binary = binary
        self.pipe_dir, self.log_dir = run_dir / "mps-pipe", run_dir / "mps-log"
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def find_binary() -> str:
        """The control program's path, else a ConfigError saying what is missing."""
        binary = shutil.which(CONTROL)
        if binary is None:
            raise ConfigError(f"config key 'mps': true needs NVIDIA's {CONTROL} (the driver's utilities) on "
                              "PATH, and it is not there; install it or set mps to false")
        return binary

    def _environ(self) -> dict[str, str]:
        env = dict(os.environ, **self.env)
        env.pop("CUDA_VISIBLE_DEVICES", None)  # the server sees every GPU; each client picks its own by index
        return env

    def _ask(self, command: str, timeout_s: float = 5.0) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary], input=command + "\n", env=self._environ(), capture_output=True,
                              text=True, timeout=timeout_s)

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the daemon and wait until it answers; a ConfigError with its log where it does not."""
        for path in (self.pipe_dir, self.log_dir):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.log_dir / "control.out", "wb") as out:
            self.proc = subprocess.Popen([self.binary, "-f"], env=self._environ(), stdout=out,
                                         stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self._ask("get_server_list", 2.0).returncode == 0:
                    log.info("MPS control daemon started (pid %d, pipes in %s): the workers are its clients",
                             self.proc.pid, self.pipe_dir)
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.1)
        status = self.proc.poll()
        self.stop()
        why = f"it exited with status {status}" if status is not None else f"no answer within {timeout_s:.0f} s"
        raise ConfigError(f"config key 'mps': the MPS control daemon did not start: {why} "
                          f"({self._log_tail() or 'no output'})")

    def _log_tail(self) -> str:
        lines = []
        for name in ("control.out", "control.log"):
            path = self.log_dir / name
            if path.is_file():
                lines += path.read_text(errors="replace").strip().splitlines()[-3:]
        return " | ".join(lines)

    def stop(self, timeout_s: float = 10.0) -> None:
        """``quit`` (the server exits with it once its clients have), then the process waited for."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self._ask("quit", timeout_s)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("the MPS control daemon did not quit within %.0f s: killed", timeout_s)
                self.proc.kill()
                self.proc.wait()
        log.info("MPS control daemon stopped (status %s)", self.proc.returncode)
        self.proc = None
