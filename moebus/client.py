"""The ZeroMQ client of moebus (also what the api uses). ``Client(address)`` talks to the broker's
frontend; it is safe to use from many threads: one IO thread owns the DEALER socket, callers hand
messages to it over one inproc PUSH socket (used under a lock, which is the memory barrier ZeroMQ
asks for when a socket changes threads; one socket per thread would grow with every thread that
ever called) and read replies from their own queues.

    client = Client("tcp://127.0.0.1:5555")
    for part in client.generate(prompt="Hello", max_tokens=16, temperature=0):
        print(part.text, end="")

Liveness both ways: the IO thread PINGs the broker every ``heartbeat_s`` (the broker cancels the
requests of a client silent for ``broker.client_timeout_s``). A broker that closes the connection
(dead) or stays silent for ``dead_after_s`` (hung) is *down*: every waiting request ends at once with
a 503 error and new ones are refused with 503 until it answers again. A request whose replies pile
up unread (``MAX_PENDING_REPLIES``) is cancelled and ends with an error: nothing is dropped silently.
A reply the codec refuses is logged and counted (``undecodable_replies``); when its header names a
waiting request, that request ends at once with a 500 error and is cancelled, instead of waiting for
its timeout.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid

import numpy as np
import zmq
from pydantic import ValidationError

from moebus.common import transport, wire
from moebus.common.errors import RequestError, ServerBusy, Unavailable
from moebus.common.protocol import (Cancel, Constraint, Detokenize, DetokenizeReply, Error, Final, Generate, Info, InfoReply,
                                    Message, Partial, Ping, Pong, Sampling, Tokenize, TokenizeReply, Vram, VramReply)

log = logging.getLogger("moebus.client")
_ids = itertools.count()
HEARTBEAT_ID = "~heartbeat"  # the IO thread's own pings; never a request id (those are uuids)
MAX_PENDING_REPLIES = 4096  # unread replies of one request before it is cancelled
MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
LOG_EVERY_S = 1.0  # undecodable replies are logged at most this often (with the count), never one line each


class Replies(queue.Queue):
    """One request's replies. Unbounded in type, bounded in use: past MAX_PENDING_REPLIES the IO
    thread puts one last Error and stops delivering, so a reader always ends."""


def error_from_message(msg: Error) -> RequestError:
    cls = ServerBusy if msg.status == 503 and msg.type == "server_busy" else \
        Unavailable if msg.status == 503 else RequestError
    err = cls(msg.message, param=msg.param, code=msg.code)
    err.http_status = msg.status
    err.kind = msg.type
    return err


class Stream:
    """Iterate to get Partial messages; afterwards ``final`` holds the Final. Raises RequestError
    (with http_status) when the broker answers ERROR. Closing it early cancels the request."""

    def __init__(self, client: "Client", request_id: str, replies: queue.Queue, timeout_s: float):
        self.client = client
        self.id = request_id
        self._replies = replies
        self._timeout_s = timeout_s
        self.final: Final | None = None
        self._done = False
        self._last_s = time.monotonic()

    def __iter__(self):
        return self

    def __next__(self) -> Partial:
        if self._done:
            raise StopIteration
        try:
            msg = self._replies.get(timeout=self._timeout_s)
        except queue.Empty:
            self._silent()
        return self._take(msg)

    def poll(self, wait_s: float) -> Partial | None:
        """Like next(), but None when nothing came within ``wait_s`` (the request goes on), so that
        a caller can check on its own client meanwhile (the api: has the HTTP client gone?)."""
        if self._done:
            raise StopIteration
        try:
            msg = self._replies.get(timeout=wait_s)
        except queue.Empty:
            if time.monotonic() - self._last_s > self._timeout_s:
                self._silent()
            return None
        return self._take(msg)

    def _silent(self):
        self.close()
        raise Unavailable(f"no answer from the broker in {self._timeout_s:.0f} s") from None

    def _take(self, msg) -> Partial:
        self._last_s = time.monotonic()
        if isinstance(msg, Partial):
            return msg
        self._finish()
        if isinstance(msg, Final):
            self.final = msg
            raise StopIteration
        raise error_from_message(msg)

    def _finish(self) -> None:
        self._done = True
        self.client._forget(self.id)

    def close(self) -> None:
        """Cancel the request if it has not finished."""
        if not self._done:
            self._finish()
            self.client.cancel(self.id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def collect(self) -> dict:
        tokens, logprobs, text, top = [], [], [], []
        for part in self:
            tokens += part.tokens
            logprobs += part.logprobs
            text.append(part.text)
            top += part.top_logprobs or []
        return {"id": self.id, "tokens": tokens, "logprobs": logprobs, "text": "".join(text),
                "top_logprobs": top, "finish_reason": self.final.finish_reason,
                "prompt_tokens": self.final.prompt_tokens, "completion_tokens": self.final.completion_tokens}


class Client:
    def __init__(self, address: str, timeout_s: float = 600.0, server_key: str | None = None,
                 heartbeat_s: float = 1.0, dead_after_s: float = 5.0, keys: tuple[str, str] | None = None,
                 curve: bool | None = None, max_message_bytes: int | None = None):
        """``server_key``: the broker's public CURVE key, needed for a non-loopback tcp address;
        ``keys``: this client's (public, secret) CURVE pair, when the broker allow-lists clients."""
        self.address = address
        self.server_key = server_key
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.max_message_bytes = max_message_bytes  # the broker's max_request_bytes, when known
        self.is_up = True  # until the broker is found dead or silent (read without the lock: a flag)
        self.down_reason = ""
        self.undecodable_replies = 0  # replies the codec refused (written by the IO thread only)
        self._logged_s = -LOG_EVERY_S
        self._ctx = zmq.Context.instance()
        self._inproc = f"inproc://moebus-client-{os.getpid()}-{next(_ids)}"
        self._pull = transport.make_socket(self._ctx, zmq.PULL)
        self._pull.bind(self._inproc)
        self._push = transport.make_socket(self._ctx, zmq.PUSH)
        self._push.connect(self._inproc)
        self._push_lock = threading.Lock()
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # made here so that a bad address or a missing key fails the constructor, not the IO thread;
        # from now on only the IO thread touches it (starting the thread is the memory barrier)
        self._dealer = transport.make_socket(self._ctx, zmq.DEALER)
        self._monitor = self._dealer.get_monitor_socket(MONITOR_EVENTS)
        transport.secure_connect(self._dealer, address, server_key, keys, curve)
        self._thread = threading.Thread(target=self._io_loop, name="moebus-client", daemon=True)
        self._thread.start()

    # -- public API -----------------------------------------------------------------------------

    def generate(self, prompt: str | None = None, prompt_tokens: list[int] | None = None,
                 messages: list[dict] | None = None, request_id: str | None = None,
                 images: list[bytes] | None = None, tools: list[dict] | None = None,
                 chat_template_kwargs: dict | None = None, image_group: str | None = None,
                 image_group_size: int = 1, constraint: dict | None = None, **sampling) -> Stream:
        """Start a request and stream it. ``sampling``: fields of protocol.Sampling. ``images``: the
        files (PNG, JPEG, WebP, GIF) in the order of the prompt's image placeholders (docs/zeromq.md).
        ``tools`` and ``chat_template_kwargs`` go to the chat template with ``messages``.
        ``image_group``, ``image_group_size``: this is one of that many requests with the same images
        (the choices of one completion), which share one encode of them. ``constraint``: the grammar
        the answer must follow (protocol.Constraint fields: structured outputs)."""
        request_id = request_id or uuid.uuid4().hex
        frames = [np.frombuffer(data, np.uint8) for data in images] if images else None
        message = Generate(id=request_id, prompt=prompt, prompt_tokens=prompt_tokens, messages=messages,
                           sampling=Sampling(**sampling), images=frames, tools=tools,
                           chat_template_kwargs=chat_template_kwargs, image_group=image_group,
                           image_group_size=image_group_size,
                           constraint=Constraint(**constraint) if constraint else None)
        self._register(request_id, replies := Replies())
        try:
            self._send(message)
        except RequestError:
            self._forget(request_id)
            raise
        return Stream(self, request_id, replies, self.timeout_s)

    def chat(self, messages: list[dict], **sampling) -> Stream:
        return self.generate(messages=messages, **sampling)

    def cancel(self, request_id: str) -> None:
        if not self._closed.is_set():  # a closed client's requests are gone with its connection
            self._send(Cancel(id=request_id))

    def info(self, timeout_s: float | None = None) -> dict:
        return self._call(Info(), InfoReply, timeout_s).stats

    def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None, **options) -> dict:
        """The prompt's (or the rendered chat's) token ids: ``{"tokens", "token_strs", "max_context"}``.
        ``options``: tools, chat_template_kwargs, add_generation_prompt, token_strs (protocol.Tokenize)."""
        reply = self._call(Tokenize(prompt=prompt, messages=messages, **options), TokenizeReply)
        return reply.model_dump(exclude={"id"})

    def detokenize(self, tokens: list[int]) -> str:
        return self._call(Detokenize(tokens=tokens), DetokenizeReply).text

    def ping(self, timeout_s: float = 2.0) -> bool:
        """True when the broker answers and every worker is ready."""
        try:
            return self._call(Ping(), Pong, timeout_s).ready
        except Unavailable:
            return False

    def vram(self, reserve_mib: list[float] | None = None, query: bool = False) -> dict:
        """Apply per-GPU reserves (None: back to start-up sizes) or, with query, only report."""
        try:
            message = Vram(reserve_mib=reserve_mib, query=query)
        except ValidationError as e:
            raise RequestError(f"reserve_mib: {e.errors()[0]['msg']}", param="reserve_mib") from None
        reply = self._call(message, VramReply)
        return reply.model_dump(exclude={"id", "error"} if reply.error is None else {"id"})

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        with self._push_lock:
            self._push.close()

    def _register(self, request_id: str, replies: Replies) -> None:
        """Take a request's reply queue, or raise Unavailable (503) at once while the broker is down."""
        if self.is_up:
            with self._lock:
                self._queues[request_id] = replies
            if self.is_up:  # else the IO thread went down meanwhile and may not have seen this queue
                return
            self._forget(request_id)
        raise Unavailable(f"the broker at {self.address} is down ({self.down_reason})")

    # -- internals ------------------------------------------------------------------------------

    def _call(self, message: Message, expect: type, timeout_s: float | None = None):
        """Send a control message with a fresh id and wait for the reply that echoes it."""
        message.id = uuid.uuid4().hex
        self._register(message.id, replies := Replies())
        try:
            self._send(message)
            reply = replies.get(timeout=timeout_s or self.timeout_s)
        except queue.Empty:
            raise Unavailable(f"no answer from the broker at {self.address}") from None
        finally:
            self._forget(message.id)
        if isinstance(reply, Error):
            raise error_from_message(reply)
        if not isinstance(reply, expect):
            raise Unavailable(f"unexpected reply {type(reply).__name__}")
        return reply

    def _send(self, message: Message) -> None:
        frames = wire.encode(message)
        size = sum(memoryview(f).nbytes for f in frames)
        if self.max_message_bytes and size > self.max_message_bytes:
            # ZeroMQ would drop the message *and the connection*, failing every other request on it
            err = RequestError(f"the request is {size} bytes; the broker takes at most {self.max_message_bytes} "
                               "(max_request_bytes)", code="request_too_large")
            err.http_status = 413
            raise err
        with self._push_lock:
            self._push.send_multipart(frames, copy=False)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def _io_loop(self) -> None:
        dealer = self._dealer
        poller = zmq.Poller()
        for sock in (dealer, self._pull, self._monitor):
            poller.register(sock, zmq.POLLIN)
        self._heard_s = next_beat_s = time.monotonic()
        while not self._closed.is_set():
            events = dict(poller.poll(100))
            if self._pull in events:
                while self._pull.poll(0):
                    dealer.send_multipart(self._pull.recv_multipart(copy=False), copy=False)
            if dealer in events:
                while dealer.poll(0):
                    self._heard_s = time.monotonic()
                    self._route(dealer.recv_multipart(copy=False))
            if self._monitor in events:
                self._on_monitor()
            now = time.monotonic()
            if now >= next_beat_s:
                next_beat_s = now + self.heartbeat_s
                transport.send(dealer, Ping(id=HEARTBEAT_ID))
            if self.is_up and now - self._heard_s > self.dead_after_s:
                self._down(f"no answer for {now - self._heard_s:.1f} s")
        dealer.disable_monitor()
        self._monitor.close()
        dealer.close()
        self._pull.close()

    def _on_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED and self.is_up:
                self._down("the connection closed")

    def _down(self, reason: str) -> None:
        """The broker is dead or hung: end every waiting request now (the api answers 503), and
        cancel them so that a broker that was only paused stops generating for nobody."""
        self.is_up, self.down_reason = False, reason
        with self._lock:
            waiting, self._queues = self._queues, {}
        for request_id, replies in waiting.items():
            replies.put(Error(id=request_id, message=f"the broker at {self.address} is down ({reason})",
                              type="service_unavailable", status=503))
            transport.send(self._dealer, Cancel(id=request_id))

    def _route(self, frames) -> None:
        try:
            msg = wire.decode([f.buffer for f in frames])
        except wire.WireError as e:
            self._undecodable(e)
            return
        request_id = getattr(msg, "id", None)
        if request_id == HEARTBEAT_ID:
            self.is_up = True  # answered again: new requests are taken
            return
        with self._lock:
            target = self._queues.get(request_id)
            if target is not None and target.qsize() >= MAX_PENDING_REPLIES:
                del self._queues[request_id]  # this Error is the last thing the reader gets
                msg = Error(id=request_id, message=f"{MAX_PENDING_REPLIES} replies left unread; request cancelled",
                            type="server_error", status=500)
                transport.send(self._dealer, Cancel(id=request_id))
        if target is not None:
            target.put(msg)

    def _undecodable(self, error: wire.WireError) -> None:
        """A reply the codec refused (a broker bug, a version mismatch, a foreign peer): count and
        log it; when its header named a waiting request, end that request now with a 500 error and
        cancel it, since the rest of its replies cannot be trusted either."""
        self.undecodable_replies += 1
        now = time.monotonic()
        if now - self._logged_s >= LOG_EVERY_S:
            self._logged_s = now
            log.warning("undecodable reply from %s (%d so far): %s (request %s)", self.address,
                        self.undecodable_replies, error, error.request_id or "unknown")
        request_id = error.request_id
        with self._lock:
            target = self._queues.pop(request_id, None) if request_id is not None else None
        if target is None:
            return
        target.put(Error(id=request_id, message=f"undecodable reply from the broker: {error}",
                         type="server_error", code="undecodable_reply", status=500))
        transport.send(self._dealer, Cancel(id=request_id))
