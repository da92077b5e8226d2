"""The api's way to the broker: one ZeroMQ ``Client`` per WSGI worker process, made on first use,
so that no socket or IO thread exists before the api forks its workers."""
from __future__ import annotations

import os
import threading

from flask import current_app

from moebus.client import Client
from moebus.common import transport

PING_TIMEOUT_S = 2.0
INFO_TIMEOUT_S = 10.0


def connect_address(frontend: str) -> str:
    """The broker may bind a wildcard (``tcp://*:5555``, ``tcp://0.0.0.0:5555``); connect to loopback."""
    for wildcard, local in (("tcp://*:", "tcp://127.0.0.1:"), ("tcp://0.0.0.0:", "tcp://127.0.0.1:"),
                            ("tcp://[::]:", "tcp://[::1]:")):
        if frontend.startswith(wildcard):
            return local + frontend[len(wildcard):]
    return frontend


class BrokerLink:
    def __init__(self, broker, max_message_bytes: int | None = None):
        """``broker``: the broker section of the settings (frontend address, CURVE keys, heartbeat);
        ``max_message_bytes``: the broker's max_request_bytes (larger requests are a 413 here)."""
        self.max_message_bytes = max_message_bytes
        self.address = connect_address(broker.frontend)
        self.server_key = broker.curve_public_key
        self.keys = transport.client_keys(broker)
        self.curve = not transport.is_loopback(broker.frontend)  # a wildcard bind serves CURVE on loopback too
        self.heartbeat_s = broker.heartbeat_s
        # a broker paused for a few beats (a long collection) is not dead yet: streams wait it out
        self.dead_after_s = max(5.0, (broker.heartbeat_liveness + 2) * broker.heartbeat_s)
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._pid: int | None = None
        self._model: dict | None = None

    @property
    def client(self) -> Client:
        with self._lock:
            if self._client is None or self._pid != os.getpid():  # a forked copy must not share sockets
                client = Client(self.address, server_key=self.server_key, heartbeat_s=self.heartbeat_s,
                                dead_after_s=self.dead_after_s, keys=self.keys,
                                curve=self.curve, max_message_bytes=self.max_message_bytes)
                self._client, self._pid, self._model = client, os.getpid(), None
            return self._client

    def info(self) -> dict:
        return self.client.info(timeout_s=INFO_TIMEOUT_S)

    def is_ready(self) -> bool:
        client = self.client
        return client.is_up and client.ping(timeout_s=PING_TIMEOUT_S)

    def model(self) -> dict:
        """The served model's name and context, asked once: it does not change while a broker lives."""
        if self._model is None:
            info = self.info()
            self._model = {"name": info["model"], "max_context": info["max_context"], "vision": bool(info.get("vision"))}
        return self._model

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client = None


def current_link() -> BrokerLink:
    """The link of the app serving the current request."""
    return current_app.extensions["moebus"]
