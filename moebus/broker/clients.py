"""Client liveness, seen from the broker: when each ZeroMQ client (a ROUTER identity) last sent
anything. moebus.client PINGs every second; a client silent for ``client_timeout_s`` has vanished
and the broker cancels its requests, so they stop holding KV slots and queue places."""
from __future__ import annotations

import time


class ClientTable:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.last_seen_s: dict[bytes, float] = {}

    def seen(self, client: bytes, now: float | None = None) -> None:
        self.last_seen_s[client] = time.monotonic() if now is None else now

    def vanished(self, clients_with_requests: set[bytes], now: float) -> set[bytes]:
        """The clients among those holding requests that have been silent too long."""
        gone = {c for c in clients_with_requests if now - self.last_seen_s.get(c, now) > self.timeout_s}
        for c in set(self.last_seen_s) - clients_with_requests:  # idle clients: nothing to cancel, forget
            if now - self.last_seen_s[c] > self.timeout_s:
                del self.last_seen_s[c]
        return gone

    def forgive(self, now: float) -> None:
        """The broker itself stalled (a long pause): nobody could be heard meanwhile."""
        for c in self.last_seen_s:
            self.last_seen_s[c] = now
