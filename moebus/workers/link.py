"""The worker's side of the broker connection (the "worker API"): an IO thread owns the DEALER
socket, sends heartbeats while the compute thread is busy inside a long step, notices a silent
broker and reconnects (re-sending READY). The compute thread talks to it through a queue (in) and
an inproc PAIR socket (out), so every ZeroMQ socket is used by one thread only."""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid

import zmq

from moebus.common import transport, wire
from moebus.common.errors import ConfigError
from moebus.common.protocol import Heartbeat, Message, Ready

log = logging.getLogger("moebus.worker")


class BrokerLink:
    def __init__(self, address: str, identity: str, heartbeat_s: float = 1.0, liveness: int = 3,
                 server_key: str | None = None):
        self.address = address
        self.server_key = server_key
        if not transport.is_loopback(address) and not server_key:
            raise ConfigError(f"connecting to {address} (not loopback) needs broker.curve_public_key")
        self.identity = identity.encode()
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.generation = uuid.uuid4().hex[:12]
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.ctx = zmq.Context.instance()
        self._pipe_addr = f"inproc://link-{self.generation}"
        self._pipe_io = transport.make_socket(self.ctx, zmq.PAIR)
        self._pipe_io.bind(self._pipe_addr)
        self._pipe = transport.make_socket(self.ctx, zmq.PAIR)
        self._pipe.connect(self._pipe_addr)
        self._ready: Ready | None = None
        self._stop = threading.Event()
        self.dropped_messages = 0
        self._thread = threading.Thread(target=self._io_loop, name="broker-link", daemon=True)

    # -- compute-thread side ---------------------------------------------------------------

    def start(self, ready: Ready) -> None:
        self._ready = ready
        self._thread.start()

    def send(self, message: Message) -> None:
        transport.send(self._pipe, message)

    def recv(self, timeout_s: float | None = None) -> Message | None:
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pipe.close()

    # -- IO thread ---------------------------------------------------------------------------

    def _connect(self):
        sock = transport.make_socket(self.ctx, zmq.DEALER, identity=self.identity)
        transport.secure_connect(sock, self.address, self.server_key)
        transport.send(sock, self._ready)
        return sock

    def _io_loop(self) -> None:
        sock = self._connect()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._pipe_io, zmq.POLLIN)
        last_heard = next_beat = time.monotonic()
        while not self._stop.is_set():
            events = dict(poller.poll(timeout=int(self.heartbeat_s * 250)))
            now = time.monotonic()
            if self._pipe_io in events:
                while self._pipe_io.poll(0):
                    sock.send_multipart(self._pipe_io.recv_multipart(copy=False), copy=False)
            if sock in events:
                while sock.poll(0):
                    last_heard = now
                    self._deliver(sock.recv_multipart(copy=False))
            if now >= next_beat:
                transport.send(sock, Heartbeat(generation=self.generation))
                next_beat = now + self.heartbeat_s
            if now - last_heard > self.heartbeat_s * self.liveness:
                log.warning("broker silent for %.1f s; reconnecting to %s", now - last_heard, self.address)
                poller.unregister(sock)
                sock.close()
                sock = self._connect()
                poller.register(sock, zmq.POLLIN)
                last_heard = now
        sock.close()
        self._pipe_io.close()

    def _deliver(self, frames) -> None:
        try:
            message = wire.decode([f.buffer for f in frames])
        except wire.WireError as e:
            self.dropped_messages += 1  # nobody to answer: the broker sent garbage, keep serving
            log.error("dropped an invalid message from the broker: %s", e)
            return
        if not isinstance(message, Heartbeat):
            self.inbox.put(message)
