"""The broker's end of the vision zygote's control socket (a Unix stream socket that the zygote
binds and owns in its one loop). Both ways it carries JSON lines, never pickle:

    broker -> zygote   {"cmd": "start", "gpu": G}  fork a fresh vision worker on GPU G (worker order)
                       {"cmd": "kill"}   SIGKILL the current one (a hung start, missed heartbeats)
    zygote -> broker   {"event": "hello", "pid": P, "charge_bytes": B, "cuda_bytes": C}  weights in host RAM,
                       ready to fork (B: a worker's charge on cpu; C: LLaVA's weights and scratch on a cuda device)
                       {"event": "started", "pid": P}
                       {"event": "exited", "pid": P, "status": S, "reason": "..."}

Every call is non-blocking, so the broker's poll loop can call ``poll`` on each turn."""
from __future__ import annotations

import json
import logging
import socket

log = logging.getLogger("moebus.broker")
MAX_LINE_BYTES = 64 * 1024


class ZygoteControl:
    def __init__(self, path: str):
        self.path = path
        self.sock: socket.socket | None = None
        self.buffer = b""

    @property
    def is_connected(self) -> bool:
        return self.sock is not None

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)  # local and listening, or refused at once
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        self.sock, self.buffer = sock, b""

    def poll(self) -> list[dict]:
        """Events received since the last call; ``{"event": "gone"}`` when the zygote went away."""
        if self.sock is None:
            self._connect()
            if self.sock is None:
                return []
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return self._lines() + self._gone()
                self.buffer += chunk
        except BlockingIOError:
            pass
        except OSError:
            return self._lines() + self._gone()
        if len(self.buffer) > MAX_LINE_BYTES:
            log.error("vision zygote sent an over-long line; reconnecting")
            return self._gone()
        return self._lines()

    def _lines(self) -> list[dict]:
        *lines, self.buffer = self.buffer.split(b"\n")
        events = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and isinstance(event.get("event"), str):
                events.append(event)
            else:
                log.error("vision zygote sent an invalid control line")
        return events

    def _gone(self) -> list[dict]:
        self.close()
        return [{"event": "gone"}]

    def send(self, command: str, **fields) -> bool:
        if self.sock is None:
            return False
        try:
            self.sock.sendall(json.dumps({"cmd": command, **fields}).encode() + b"\n")
            return True
        except OSError:
            self.close()
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.buffer = None, b""
