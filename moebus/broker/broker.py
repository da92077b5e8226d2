"""The broker: one process, one poll loop. It owns the request queue and scheduler, sequence state,
the tokenizer, worker liveness, VRAM fan-out and all metrics state. Clients talk to the frontend
ROUTER, workers to the backend ROUTER; decode steps travel gpu0 -> gpu1 -> ... (one per stage in
flight when pipelined, see broker/inflight.py) and the last stage's token ids come back here to be
streamed.

Nothing a request or a peer does may end this loop: every handler is guarded, and a failure fails
only the requests it concerns (see docs/operations.md). Every wait has a deadline: a stage that does
not answer a STEP in ``broker.step_timeout_s`` is restarted and its step's requests fail; a client
silent for ``broker.client_timeout_s`` has its requests cancelled."""
from __future__ import annotations

import itertools
import logging
import signal
import time

import zmq

from moebus.broker.client_messages import ClientMessages
from moebus.broker.grammar import warm_engine
from moebus.broker.clients import ClientTable
from moebus.broker.history import History
from moebus.broker.inflight import Inflight
from moebus.broker.outbox import Outbox
from moebus.broker.scheduler import Scheduler, prefill_tokens_beside_decode
from moebus.broker.stats import Stats
from moebus.broker.steps import StepDriver
from moebus.broker.streaming import Streaming
from moebus.broker.supervision import Supervision
from moebus.broker.tokenize_pool import TokenizePool
from moebus.broker.vram_control import VramControl
from moebus.broker.worker_messages import WorkerMessages
from moebus.broker.worker_pool import WorkerPool
from moebus.common import transport
from moebus.common import gc_pauses
from moebus.common.model_config import ModelConfig
from moebus.common.protocol import Error, Shutdown
from moebus.common.tokenizer import TextTokenizer

log = logging.getLogger("moebus.broker")
POLL_MS = 50
MAX_DRAIN = 256  # messages handled per socket per loop turn, so neither side starves the other
FRONTEND_SNDHWM = 100_000  # replies queued per client before a send fails (then its requests fail)


class Broker(ClientMessages, WorkerMessages, StepDriver, Streaming, Supervision, Outbox):
    """The broker's state and its loop. The handlers live by family in the mixins' files:
    client_messages.py, worker_messages.py, steps.py, streaming.py, supervision.py, outbox.py."""

    def __init__(self, settings, model_config: ModelConfig, tokenizer: TextTokenizer, pool: WorkerPool,
                 model_name: str, backend_address: str, children=(), vision=None):
        """``vision``: None for a model without a vision tower, else a factory taking VisionHooks and
        the Stats and returning the broker/vision.py VisionLifecycle that this loop drives."""
        self.settings = settings
        self.children = list(children)  # supervised besides the workers (the api server)
        self.config = model_config
        self.tokenizer = tokenizer
        self.pool = pool
        self.model_name = model_name
        self.scheduler = Scheduler(settings.max_batch, settings.max_queue, settings.max_step_tokens,
                                   prefill_tokens_beside_decode(settings.max_prefill_tokens_beside_decode,
                                                                settings.device))
        self.stats = Stats()
        self.history = History()  # what the dashboard plots over the last minutes
        self.ctx = zmq.Context.instance()
        keys = settings.broker.curve_public_key, settings.broker.curve_secret_key
        allowed = list(settings.broker.curve_client_keys) + [k for k in [settings.broker.curve_client_public_key] if k]
        self.frontend = transport.make_socket(self.ctx, zmq.ROUTER, max_bytes=settings.max_request_bytes)
        # an undeliverable reply raises instead of vanishing (ROUTER drops silently by default)
        self.frontend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.frontend.setsockopt(zmq.SNDHWM, FRONTEND_SNDHWM)
        transport.secure_bind(self.frontend, settings.broker.frontend, *keys, allowed_keys=allowed)
        self.backend = transport.make_socket(self.ctx, zmq.ROUTER)
        self.backend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # a reconnecting or restarted worker (a vision worker forks in milliseconds) may connect before
        # the broker has seen its predecessor's connection close: the new connection takes the identity
        self.backend.setsockopt(zmq.ROUTER_HANDOVER, 1)
        transport.secure_bind(self.backend, backend_address, *keys, allowed_keys=allowed)
        b = settings.broker
        self.inflight = Inflight(len(pool), b.pipeline)
        self.vram = VramControl(len(pool), self._send_worker, self._reply, b.max_vram_queue, b.vram_timeout_s,
                                observe=self._on_vram_answer)
        self.clients = ClientTable(b.client_timeout_s)
        self.tokenize = TokenizePool(self.ctx, tokenizer, model_config.vocab_size, settings.max_context,
                                     b.tokenizer_threads, max_pending=max(settings.max_queue, 1))
        warm_engine(tokenizer, model_config.vocab_size)  # structured outputs' tokenizer, off the loop
        self.cancelled_while_tokenizing: set[str] = set()
        self.step_ids = itertools.count(1)
        self.last_turn_s = time.monotonic()
        self.exit_status = 0
        self.fatal_error: str | None = None  # why the start cannot succeed (supervision.py); run_broker raises it
        self.stopping_since: float | None = None
        self.next_beat_s = self.next_info_s = 0.0
        self.vision = vision(self._vision_hooks(), self.stats) if vision else None

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        poller = zmq.Poller()
        for sock in (self.frontend, self.backend, self.tokenize.wake):
            poller.register(sock, zmq.POLLIN)
        self.pool.start()
        gc_pauses.watch(log, "broker")  # MOEBUS_GC_FREEZE, MOEBUS_LOG_GC_MS: a pause between two tokens of every stream
        if self.vision:
            self.vision.start()
        for child in self.children:
            child.start()
        try:
            while not self._guarded("drain check", self._drained, default=False):
                events = dict(poller.poll(POLL_MS))
                self._guarded("stall check", self._forgive_stall)
                if self.frontend in events:
                    self._guarded("client messages", self._drain, self.frontend, self._on_client)
                if self.backend in events:
                    self._guarded("worker messages", self._drain, self.backend, self._on_worker)
                if self.tokenize.wake in events:
                    self._guarded("tokenized prompts", self._on_tokenized)
                now = time.monotonic()
                self._guarded("supervision", self._supervise, now)
                self._guarded("heartbeats", self._beat, now)
                # a step also goes out from the last stage's reply itself (steps.py), before its
                # tokens stream; here for whatever else cleared the way (a request, a worker back)
                self._guarded("dispatch", self._dispatch, now, aborts_step=True)
        finally:
            self._shutdown()
        return self.exit_status

    def _guarded(self, what: str, fn, *args, default=None, aborts_step: bool = False):
        """Run one phase of the loop; a bug in it fails the requests it concerns, never the loop."""
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("%s failed; the broker goes on", what)
            self.stats.count("internal_errors_total")
            if aborts_step:
                self._abort_step(f"internal error in the broker ({what})")
            return default

    def _on_signal(self, signum, _frame) -> None:
        if self.stopping_since is None:
            log.info("signal %d: draining (no new requests), then stopping", signum)
            self.stopping_since = time.monotonic()

    def _drained(self) -> bool:
        if self.stopping_since is None:
            return False
        timed_out = time.monotonic() - self.stopping_since > self.settings.broker.drain_s
        if timed_out or not self.pool.all_ready():
            self._abort_step("server shutting down", status=503)  # a step that never comes back must not hold the exit
            for seq in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
                self._fail(seq, "server shutting down", status=503)
            self.vram.fail_all("server shutting down")
        return not self.scheduler.running and not self.scheduler.waiting and not self.inflight

    def _shutdown(self) -> None:
        for w in self.pool:
            if w.is_ready:
                self._send_worker(w.gpu, Shutdown())
        if self.vision:
            self.vision.stop()
        for request_id, client in list(self.tokenize.pending.items()):
            self._reply(client, Error(id=request_id, message="server shutting down", type="service_unavailable",
                                      status=503))
        self.tokenize.close()
        self.pool.stop()
        for child in self.children:
            child.stop()
        self.frontend.close()
        self.backend.close()

    @staticmethod
    def _drain(sock, handler) -> None:
        for _ in range(MAX_DRAIN):
            if not sock.poll(0):
                return
            identity, frames = transport.recv_frames(sock, routed=True)
            handler(identity, frames)
