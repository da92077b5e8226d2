"""Start real moebus processes for end-to-end tests (on free loopback ports) and clean them up."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from moebus.client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Service:
    """``moebus serve`` (or ``broker``) as a subprocess with its own config file."""

    def __init__(self, tmp: Path, model: Path | None, command: str = "serve", env: dict | None = None, **settings):
        """``model`` None: the embedded demo model. ``settings`` override the defaults below; the
        ``api`` and ``broker`` sections are merged key by key. ``env``: extra environment."""
        self.http_port = free_port()
        self.zmq_port = free_port()
        api = {"port": self.http_port, **settings.pop("api", {})}
        broker = {"frontend": f"tcp://127.0.0.1:{self.zmq_port}", "drain_s": 2.0, **settings.pop("broker", {})}
        self.config = {"model": str(model) if model else None, "device": "cpu", "max_context": 256,
                       "api": api, "broker": broker, **settings}
        self.config_file = tmp / f"moebus-{self.http_port}.json"
        self.config_file.write_text(json.dumps(self.config))
        self.log = open(tmp / f"moebus-{self.http_port}.log", "w+")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "moebus.cli", command, "--config", str(self.config_file)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.zmq_address = f"tcp://127.0.0.1:{self.zmq_port}"
        self.base_url = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout_s: float = 120, http: bool = True) -> "Service":
        client = Client(self.zmq_address)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moebus exited with {self.proc.returncode}:\n{self.logs()}")
                if client.ping(timeout_s=0.5) and (not http or self._http_ready()):
                    return self
                if time.monotonic() > deadline:
                    raise TimeoutError(f"moebus not ready in {timeout_s} s:\n{self.logs()}")
                time.sleep(0.1)
        finally:
            client.close()

    def _http_ready(self) -> bool:
        try:
            return requests.get(self.base_url + "/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-8000:]

    def worker_pids(self) -> list[int]:
        """The GPU workers' pids in stage order (gpu0 first)."""
        workers = [p for p in process_tree(self.proc.pid) if b"moebus.cli\0worker\0" in _cmdline(p)]
        return sorted(workers, key=lambda p: _gpu_of(_cmdline(p)))

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 30) -> list[int]:
        """Stop the service; returns the pids of its tree that are still alive afterwards."""
        tree = process_tree(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in tree):
            time.sleep(0.1)
        left = [p for p in tree if alive(p)]
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()
        return left


@contextmanager
def running(svc: Service, **wait):
    """``svc`` once ready (wait_ready's arguments) for the block, then stopped: every process it
    started must be gone (a fixture: ``with running(Service(...)) as svc: yield svc``)."""
    try:
        yield svc.wait_ready(**wait)
    finally:
        assert svc.stop() == []


def _gpu_of(cmdline: bytes) -> int:
    args = cmdline.split(b"\0")
    return int(args[args.index(b"--gpu") + 1]) if b"--gpu" in args else -1


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
