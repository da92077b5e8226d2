"""What the broker does with a client's message, one handler per type, and the client's side of
liveness: a client that cannot take its replies, or falls silent, has its requests cancelled.
Prompts are tokenized off the loop (broker/tokenize_pool.py); their Sequences come back through
``_on_tokenized`` and join the scheduler (or, with images, the vision lifecycle)."""
from __future__ import annotations

import logging

from moebus.broker.admission import detokenize, tokenize
from moebus.broker.clients import ClientTable
from moebus.broker.history import History
from moebus.broker.info import info_stats
from moebus.broker.scheduler import Scheduler
from moebus.broker.sequence import Sequence
from moebus.broker.stats import Stats
from moebus.broker.prompt_size import give_back_memory
from moebus.broker.tokenize_pool import TokenizePool
from moebus.broker.vision_requests import ImageRequest
from moebus.broker.vram import per_gpu_reserves
from moebus.broker.vram_control import VramControl, check_not_elastic
from moebus.broker.worker_pool import WorkerPool
from moebus.common import wire
from moebus.common.errors import RequestError, ServerBusy, Unavailable
from moebus.common.protocol import (Cancel, Detokenize, Error, Final, Generate, Heartbeat, Info, InfoReply, Ping, Pong,
                                    Tokenize, Vram, VramReply)

log = logging.getLogger("moebus.broker")


class ClientMessages:
    """The Broker's client methods (a mixin: the state is the Broker's, named below)."""

    CLIENT_HANDLERS = {Generate: "_on_generate", Cancel: "_on_cancel", Vram: "_on_vram", Info: "_on_info",
                       Ping: "_on_ping", Heartbeat: "_on_client_heartbeat", Tokenize: "_on_tokenize",
                       Detokenize: "_on_detokenize"}  # type -> method

    settings: object
    pool: WorkerPool
    scheduler: Scheduler
    tokenize: TokenizePool
    clients: ClientTable
    vram: VramControl
    history: History
    stats: Stats
    vision: object | None  # broker/vision.py's VisionLifecycle
    stopping_since: float | None
    next_info_s: float
    cancelled_while_tokenizing: set[str]

    def _on_client(self, client: bytes, frames) -> None:
        self.clients.seen(client)
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            self.stats.count("invalid_messages_total")
            self._reply(client, Error(id=e.request_id, message=f"invalid message: {e}"))
            return
        try:
            self._handle_client(client, msg)
        except RequestError as e:
            self._reply(client, Error(id=getattr(msg, "id", None), status=e.http_status, **e.to_dict()))
        except Exception:  # a bug met by one request must not take the service down with it
            log.exception("%s from a client failed", msg.TYPE.decode())
            self._reply(client, Error(id=getattr(msg, "id", None), message="internal error", type="server_error",
                                      status=500))

    def _handle_client(self, client: bytes, msg) -> None:
        handler = self.CLIENT_HANDLERS.get(type(msg))
        if handler is None:
            raise RequestError(f"unexpected message type {msg.TYPE.decode()}")
        getattr(self, handler)(client, msg)

    def _on_generate(self, client: bytes, msg: Generate) -> None:
        if self.stopping_since is not None:
            raise Unavailable("server shutting down")
        if self._id_in_use(msg.id):
            raise RequestError(f"request id {msg.id!r} is already in use", param="id")
        if len(self.scheduler.waiting) >= self.scheduler.max_queue:
            raise ServerBusy(f"server busy: {len(self.scheduler.waiting)} requests waiting (max_queue)")
        admit = None
        if self.vision is not None:  # images wait there for embeddings; every prompt's image tokens are checked
            admit = self.vision.admission
        elif msg.images:
            raise RequestError("model has no vision: image inputs are not supported", param="images",
                               code="model_has_no_vision")
        self.tokenize.submit(client, msg, admit)  # the Sequence comes back through _on_tokenized

    def _on_cancel(self, client: bytes, msg: Cancel) -> None:
        if self.vision and self.vision.cancel(msg.id, client):
            return
        seq = self.scheduler.find(msg.id)
        if seq is not None and seq.client == client:
            self._finish(seq, "cancelled")
        elif self.tokenize.pending.get(msg.id) == client:
            self.cancelled_while_tokenizing.add(msg.id)

    def _on_vram(self, client: bytes, msg: Vram) -> None:
        reserves = per_gpu_reserves(msg, len(self.pool))
        check_not_elastic(self.settings.vram_elastic, msg.query)
        self.vram.request(client, reserves, msg.query, msg.id)

    def _on_info(self, client: bytes, msg: Info) -> None:
        self._reply(client, InfoReply(id=msg.id, stats=info_stats(self)))

    def _on_ping(self, client: bytes, msg: Ping) -> None:
        self._reply(client, Pong(id=msg.id, ready=self.pool.all_ready()))

    def _on_client_heartbeat(self, client: bytes, msg: Heartbeat) -> None:
        pass  # liveness only (seen in _on_client)

    def _on_tokenize(self, client: bytes, msg: Tokenize) -> None:  # off the loop, as a GENERATE's prompt: it may be long
        self.tokenize.submit(client, msg, lambda m, _c, tok, _vocab, max_context: tokenize(m, tok, max_context))

    def _on_detokenize(self, client: bytes, msg: Detokenize) -> None:
        self.tokenize.submit(client, msg, lambda m, _c, tok, vocab_size, _ctx: detokenize(m, tok, vocab_size))

    def _on_vram_answer(self, reserves: list, reply: VramReply, query: bool, interim: bool = False) -> None:
        self.history.vram_reply(reserves, reply, query=query)
        if not interim:  # the residency changed with the size: ask INFO on the next turn (a series: at its end)
            self.next_info_s = 0.0

    def _id_in_use(self, request_id: str) -> bool:
        return bool(self.scheduler.find(request_id) or request_id in self.tokenize.pending
                    or (self.vision and self.vision.find(request_id)))

    def _on_tokenized(self) -> None:
        for item in self.tokenize.results():
            msg, client = item.msg, item.client
            if not isinstance(msg, Generate):  # TOKENIZE / DETOKENIZE: the reply or its error
                error = item.error
                self._reply(client, item.seq if error is None else
                            Error(id=msg.id, status=error.http_status, **error.to_dict()))
                item.seq = None
                give_back_memory(msg)  # a long prompt's reply is gone now: so is what it took
            elif msg.id in self.cancelled_while_tokenizing:
                self.cancelled_while_tokenizing.discard(msg.id)
                self._reply(client, Final(id=msg.id, finish_reason="cancelled", prompt_tokens=0, completion_tokens=0))
                self.stats.count("requests_cancelled_total")
            else:
                self._admit_tokenized(item)

    def _admit_tokenized(self, item) -> None:
        """A tokenized GENERATE joins the scheduler (or the vision lifecycle), or gets its ERROR."""
        msg, error = item.msg, item.error
        if error is None and self.stopping_since is not None:
            error = Unavailable("server shutting down")
        if error is None and (self.scheduler.find(msg.id) or (self.vision and self.vision.find(msg.id))):
            error = RequestError(f"request id {msg.id!r} is already in use", param="id")
        if error is None:
            try:
                if isinstance(item.seq, ImageRequest):
                    self.vision.submit(item.seq)
                else:
                    self.scheduler.submit(item.seq)
                self.stats.count("requests_total")
                return
            except RequestError as e:
                error = e
        self._reply(item.client, Error(id=msg.id, status=error.http_status, **error.to_dict()))

    def _drop_client(self, client: bytes) -> None:
        for seq in self._requests_of({client}):
            self.scheduler.remove(seq)
            self.stats.count("requests_cancelled_total")
        self.cancelled_while_tokenizing.update(i for i, c in self.tokenize.pending.items() if c == client)
        self.clients.last_seen_s.pop(client, None)

    def _requests_of(self, clients: set[bytes]) -> list[Sequence]:
        return [s for s in list(self.scheduler.running.values()) + list(self.scheduler.waiting) if s.client in clients]

    def _cancel_vanished(self, now: float) -> None:
        holders = {s.client for s in list(self.scheduler.running.values()) + list(self.scheduler.waiting)}
        for client in self.clients.vanished(holders, now):
            log.warning("client %r silent for over %.0f s: its requests are cancelled", client[:16],
                        self.clients.timeout_s)
            self._drop_client(client)
