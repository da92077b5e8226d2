"""Prompts are tokenized (and chat templates rendered) off the broker's loop: a 4 MiB prompt takes
seconds, and the loop must keep sending steps and heartbeats meanwhile. A few threads take GENERATE
messages from a bounded queue, turn each into a Sequence (or a RequestError) and hand it back on a
results queue, waking the loop through an inproc PUSH socket that each thread owns (ZeroMQ sockets
are never shared between threads); the loop polls the PULL end with its other sockets.

The threads only run pure functions of the message (admission.make_sequence); the tokenizer's
``encode`` releases the GIL, so a long prompt does not stall the loop's thread either."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from moebus.broker.admission import make_sequence
from moebus.broker.prompt_size import give_back_memory
from moebus.broker.sequence import Sequence
from moebus.common.errors import RequestError, ServerBusy
from moebus.common.protocol import Generate

log = logging.getLogger("moebus.broker")
_pool_ids = itertools.count()


@dataclass
class Tokenized:
    client: bytes
    msg: Generate
    admit: Callable = make_sequence
    seq: Sequence | Any = None  # what ``admit`` made (a Sequence, or the vision's ImageRequest)
    error: RequestError | None = None


class TokenizePool:
    def __init__(self, ctx: zmq.Context, tokenizer, vocab_size: int, max_context: int, num_threads: int,
                 max_pending: int):
        self.tokenizer, self.vocab_size, self.max_context = tokenizer, vocab_size, max_context
        self.jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self.done: queue.Queue[Tokenized] = queue.Queue()
        self.pending: dict[str, bytes] = {}  # request id -> client, while its prompt is tokenized
        self.ctx = ctx
        self.address = f"inproc://tokenize-{next(_pool_ids)}"
        self.wake = ctx.socket(zmq.PULL)  # polled by the loop
        self.wake.setsockopt(zmq.LINGER, 0)
        self.wake.bind(self.address)
        self.threads = [threading.Thread(target=self._work, name=f"tokenize-{i}", daemon=True)
                        for i in range(num_threads)]
        for t in self.threads:
            t.start()

    def submit(self, client: bytes, msg: Generate, admit=None) -> None:
        """Queue a prompt for tokenizing; ServerBusy when the queue is full. ``admit``: what turns the
        message into the object handed back as ``seq`` (default admission.make_sequence; an image
        request's comes from the vision lifecycle), called with the same arguments."""
        try:
            self.jobs.put_nowait(Tokenized(client, msg, admit=admit or make_sequence))
        except queue.Full:
            raise ServerBusy(f"server busy: {self.jobs.maxsize} prompts waiting to be tokenized") from None
        if isinstance(msg, Generate):  # a request id in use until its Sequence is back
            self.pending[msg.id] = client

    def results(self) -> list[Tokenized]:
        """What the threads finished since the last call (the loop calls this when ``wake`` polls in)."""
        while self.wake.poll(0):
            self.wake.recv()
        out = []
        while True:
            try:
                item = self.done.get_nowait()
            except queue.Empty:
                return out
            if isinstance(item.msg, Generate):
                self.pending.pop(item.msg.id, None)
            out.append(item)

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join(timeout=1)
        self.wake.close()

    def _work(self) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self.address)
        try:
            while (job := self.jobs.get()) is not None:
                try:
                    job.seq = job.admit(job.msg, job.client, self.tokenizer, self.vocab_size, self.max_context)
                except RequestError as e:
                    job.error = e
                except Exception as e:  # noqa: BLE001 - a template or tokenizer bug fails this request only
                    log.exception("tokenizing request %s failed", job.msg.id)
                    job.error = RequestError(f"internal error while tokenizing: {type(e).__name__}")
                    job.error.http_status, job.error.kind = 500, "server_error"
                give_back_memory(job.msg)  # before the result is handed on: a test measures right after
                self.done.put(job)
                try:
                    push.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass  # wake-ups already queued: the loop will find this result with theirs
        except zmq.ZMQError:
            pass  # the context is closing
        finally:
            push.close()
