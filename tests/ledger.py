"""A request ledger for fault tests: every message that reaches a client is recorded by request id,
so a test can check that each submitted id reached exactly one terminal state (FINAL or ERROR) and
nothing after it, whatever was killed meanwhile."""
from __future__ import annotations

import threading
import time
from collections import defaultdict

from moebus.client import Client
from moebus.common import wire
from moebus.common.errors import RequestError
from moebus.common.protocol import Error, Final

LONG = {"max_tokens": 240, "temperature": 0, "ignore_eos": True}


class LedgerClient(Client):
    """The real ZeroMQ client; its IO thread also notes every message it receives (by id)."""

    def __init__(self, *args, **kwargs):
        self.seen: dict[str, list[str]] = defaultdict(list)
        super().__init__(*args, **kwargs)

    def _route(self, frames) -> None:
        try:
            msg = wire.decode([f.buffer for f in frames])
            request_id = getattr(msg, "id", None)
            if isinstance(request_id, str) and not request_id.startswith("~"):
                self.seen[request_id].append(type(msg).__name__)
        except wire.WireError:
            pass
        super()._route(frames)


class Ledger:
    """Runs streams in threads; ``outcome[id]`` is ('final', reason) or ('error', status)."""

    def __init__(self, client: LedgerClient):
        self.client = client
        self.outcome: dict[str, tuple] = {}
        self.tokens: dict[str, list[float]] = defaultdict(list)  # arrival times of each stream's tokens
        self.threads: list[threading.Thread] = []
        self.ids: list[str] = []
        self.lock = threading.Lock()

    def start(self, request_id: str, prompt_tokens=(5, 17, 99), **sampling) -> None:
        t = threading.Thread(target=self._run, args=(request_id, list(prompt_tokens), {**LONG, **sampling}),
                             daemon=True)
        self.threads.append(t)
        self.ids.append(request_id)
        t.start()

    def _run(self, request_id, prompt_tokens, sampling) -> None:
        try:
            stream = self.client.generate(prompt_tokens=prompt_tokens, request_id=request_id, **sampling)
            for _ in stream:
                self.tokens[request_id].append(time.monotonic())
            result = ("final", stream.final.finish_reason)
        except RequestError as e:
            result = ("error", e.http_status)
        with self.lock:
            self.outcome[request_id] = result

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def streaming(self, n: int, timeout_s: float = 30) -> None:
        """Wait until ``n`` streams have each had a token."""
        deadline = time.monotonic() + timeout_s
        while sum(1 for v in self.tokens.values() if v) < n:
            assert time.monotonic() < deadline, f"only {len(self.tokens)} of {n} streams started"
            time.sleep(0.05)

    def check(self) -> dict[str, tuple]:
        """Every started id ended exactly once, and the broker sent nothing after its terminal message."""
        assert all(not t.is_alive() for t in self.threads), "a request never ended"
        assert sorted(self.outcome) == sorted(self.ids), (self.outcome, self.ids)
        time.sleep(0.5)  # anything the broker still sends would have arrived by now
        for request_id in self.ids:
            kinds = self.client.seen.get(request_id, [])
            terminal = [k for k in kinds if k in (Final.__name__, Error.__name__)]
            # at most one terminal message from the broker, nothing after it; none only when the
            # client itself ended the request (the broker was down)
            assert len(terminal) <= 1 and (not terminal or kinds[-1] == terminal[0]), (request_id, kinds)
            assert terminal or self.outcome[request_id] == ("error", 503), (request_id, kinds, self.outcome[request_id])
        return self.outcome
