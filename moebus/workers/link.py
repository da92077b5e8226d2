"""The worker's side of the broker connection (the "worker API"): an IO thread owns the DEALER
socket, sends heartbeats while the compute thread is busy inside a long step, notices a silent
broker and reconnects (re-sending READY). The compute thread talks to it through a queue (in) and
an inproc PAIR socket (out), so every ZeroMQ socket is used by one thread only."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid

import zmq

from moebus.common import transport, wire
from moebus.common.errors import ConfigError
from moebus.common.protocol import Heartbeat, Message, Ready, Step, Vram, VramReply, WorkerError

log = logging.getLogger("moebus.worker")
MAX_INBOX = 64  # the broker sends one STEP at a time; more waiting means something is wrong
# MOEBUS_LOG_DECODE_MS=N (default 0: off): a message whose decoding (on the link's thread) took over N ms is logged
# with its size: a prompt chunk's step carries its image rows again each time (issue 20: 3.5-4.9 ms before each)
LOG_DECODE_MS = float(os.environ.get("MOEBUS_LOG_DECODE_MS", "0") or 0)


class Inbox(queue.Queue):
    """The compute thread's queue of messages, which it may also look at without taking one."""

    def peek(self, timeout_s: float) -> Message | None:
        """The next message, left in place; None if none came within ``timeout_s``."""
        with self.not_empty:
            if not self._qsize():
                self.not_empty.wait(timeout_s)
            return self.queue[0] if self._qsize() else None


class BrokerLink:
    def __init__(self, address: str, identity: str, heartbeat_s: float = 1.0, liveness: int = 3,
                 server_key: str | None = None, keys: tuple[str, str] | None = None):
        """``keys``: this worker's own CURVE pair, which a broker on non-loopback tcp allow-lists."""
        self.address = address
        self.server_key = server_key
        self.keys = keys
        if not transport.is_loopback(address) and not server_key:
            raise ConfigError(f"connecting to {address} (not loopback) needs broker.curve_public_key")
        self.identity = identity.encode()
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.generation = uuid.uuid4().hex[:12]
        self.inbox = Inbox(maxsize=MAX_INBOX)
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

    def peek(self, timeout_s: float) -> Message | None:
        """The next message without taking it (a worker looks for the step after the one it runs)."""
        return self.inbox.peek(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pipe.close()

    # -- IO thread ---------------------------------------------------------------------------

    def _connect(self):
        sock = transport.make_socket(self.ctx, zmq.DEALER, identity=self.identity)
        transport.secure_connect(sock, self.address, self.server_key, self.keys)
        transport.send(sock, self._ready)
        return sock

    def _io_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve_io()
            except Exception:  # noqa: BLE001 - the link must outlive any one bad turn
                log.exception("broker link failed; reconnecting")
                time.sleep(self.heartbeat_s)
        self._pipe_io.close()

    def _serve_io(self) -> None:
        sock = self._connect()
        try:
            self._pump(sock)
        finally:
            sock.close()

    def _pump(self, sock) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._pipe_io, zmq.POLLIN)
        last_heard = next_beat = time.monotonic()
        while not self._stop.is_set():
            events = dict(poller.poll(timeout=int(self.heartbeat_s * 250)))
            now = time.monotonic()
            if self._pipe_io in events:
                while self._pipe_io.poll(0):
                    transport.send_frames(sock, transport.recv_all(self._pipe_io))
            if sock in events:
                while sock.poll(0):
                    last_heard = now
                    self._deliver(sock, transport.recv_all(sock))
            if now >= next_beat:
                transport.send(sock, Heartbeat(generation=self.generation))
                next_beat = now + self.heartbeat_s
            if now - last_heard > self.heartbeat_s * self.liveness:
                log.warning("broker silent for %.1f s; reconnecting to %s", now - last_heard, self.address)
                return  # _io_loop connects a new socket and sends READY again

    def _deliver(self, sock, frames) -> None:
        started = time.perf_counter()
        try:
            message = wire.decode([f.buffer for f in frames])
            if LOG_DECODE_MS > 0 and (took_ms := 1e3 * (time.perf_counter() - started)) > LOG_DECODE_MS:
                log.info("%s: %s of %.2f MB decoded in %.1f ms", self.identity.decode(), type(message).__name__,
                         sum(f.buffer.nbytes for f in frames) / 1e6, took_ms)
        except wire.WireError as e:
            self.dropped_messages += 1  # nobody to answer: the broker sent garbage, keep serving
            log.error("dropped an invalid message from the broker: %s", e)
            return
        if isinstance(message, Heartbeat):
            return
        try:
            self.inbox.put_nowait(message)
        except queue.Full:  # answer instead of dropping, so that the broker's wait ends
            self.dropped_messages += 1
            log.error("inbox full (%d): %s refused", MAX_INBOX, type(message).__name__)
            refusal = self._refusal(message)
            if refusal is not None:
                transport.send(sock, refusal)

    def _refusal(self, message: Message):
        text = f"worker inbox full ({MAX_INBOX} messages waiting)"
        if isinstance(message, Vram):
            return VramReply(id=message.id, reserve_mib=0, free_mib=0, expert_slots=0, expert_cache_mib=0, error=text)
        if isinstance(message, Step):
            return WorkerError(generation=self.generation, step_id=message.step_id, message=text)
        return None
