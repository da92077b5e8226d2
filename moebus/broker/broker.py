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
from moebus.broker.clients import ClientTable
from moebus.broker.history import History
from moebus.broker.inflight import Inflight
from moebus.broker.outbox import Outbox
from moebus.broker.scheduler import Scheduler
from moebus.broker.stats import Stats
from moebus.broker.steps import StepDriver
from moebus.broker.streaming import Streaming
from moebus.broker.tokenize_pool import TokenizePool
from moebus.broker.vision import VisionHooks
from moebus.broker.vram_control import VramControl
from moebus.broker.worker_pool import WorkerPool, WorkerState, ready_mismatch
from moebus.common import transport, wire
from moebus.common.model_config import ModelConfig
from moebus.common.protocol import (Error, Heartbeat, Info, InfoReply, Ready, Shutdown, StepReply, VramReply,
                                    WorkerError)
from moebus.common.tokenizer import TextTokenizer

log = logging.getLogger("moebus.broker")
POLL_MS = 50
INFO_EVERY_S = 2.0
MAX_DRAIN = 256  # messages handled per socket per loop turn, so neither side starves the other
MAX_QUICK_EXITS = 5  # of a supervised child (the api) before serve gives up and exits non-zero
FRONTEND_SNDHWM = 100_000  # replies queued per client before a send fails (then its requests fail)


class Broker(ClientMessages, StepDriver, Streaming, Outbox):
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
        self.scheduler = Scheduler(settings.max_batch, settings.max_queue, settings.max_step_tokens)
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
        self.cancelled_while_tokenizing: set[str] = set()
        self.step_ids = itertools.count(1)
        self.last_turn_s = time.monotonic()
        self.exit_status = 0
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

    def _forgive_stall(self) -> None:
        """After a pause of the broker itself (a stalled disk, a long collection) nobody could be
        heard: restart the liveness clocks instead of declaring every peer dead."""
        now = time.monotonic()
        if now - self.last_turn_s > self.settings.broker.heartbeat_s:
            log.warning("the broker loop stalled for %.1f s; liveness clocks restarted", now - self.last_turn_s)
            self.clients.forgive(now)
            for w in self.pool:
                w.last_seen_s = max(w.last_seen_s, now)
            self.inflight.forgive(now)
        self.last_turn_s = now

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

    # -- clients ----------------------------------------------------------------------------------

    def info(self) -> dict:
        return {"ready": self.pool.all_ready(), "model": self.model_name,
                "requests_running": len(self.scheduler.running), "requests_waiting": len(self.scheduler.waiting),
                "max_context": self.settings.max_context, "vocab_size": self.config.vocab_size,
                "requests_tokenizing": len(self.tokenize.pending), "vram_reserves_mib": list(self.vram.reserves),
                **self.stats.to_dict(), **(self.vision.info() if self.vision else {"vision_loaded": 0}),
                "history": self.history.to_dict(),
                "gpus": [{"gpu": w.gpu, "ready": w.is_ready, "layers": [w.layers.start, w.layers.stop],
                          "restarts": w.child.restarts if w.child else 0, **w.info, **w.vram} for w in self.pool]}

    # -- workers ----------------------------------------------------------------------------------

    def _on_worker(self, identity: bytes, frames) -> None:
        if identity == b"vision" and self.vision is not None:
            self._on_vision(frames)
            return
        worker = self.pool.by_identity(identity)
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            self.stats.count("invalid_messages_total")
            log.error("invalid message from worker %r: %s", identity[:16], e)
            step = self.inflight.at_stage(worker.gpu) if worker is not None else None
            if step is not None:
                self._abort_step(f"gpu{worker.gpu} sent an undecodable reply", step=step)
            return
        if worker is None:
            log.error("message from unknown worker %r dropped", identity[:16])
            return
        try:
            self._handle_worker(worker, msg)
        except Exception:  # noqa: BLE001 - a bug met by one reply fails that step, not the broker
            log.exception("%s from gpu%d failed", msg.TYPE.decode(), worker.gpu)
            self.stats.count("internal_errors_total")
            step = self.inflight.at_stage(worker.gpu)
            if step is not None:
                self._abort_step(f"internal error handling gpu{worker.gpu}'s {msg.TYPE.decode()}", step=step)

    def _handle_worker(self, worker: WorkerState, msg) -> None:
        if isinstance(msg, Ready):
            self._on_ready(worker, msg)
            return
        if getattr(msg, "generation", worker.generation) != worker.generation:
            return  # a reply from an earlier life of this worker: its state is gone
        if not worker.is_ready:
            return  # a worker the broker has given up on: only a READY brings it back
        worker.last_seen_s = time.monotonic()
        if isinstance(msg, StepReply):
            self._on_step_reply(worker, msg)
        elif isinstance(msg, WorkerError):
            self._on_worker_error(worker, msg)
        elif isinstance(msg, VramReply):
            if self.vram.on_reply(worker.gpu, msg):
                worker.restoring = False
                log.info("gpu%d: reserve %s MiB restored", worker.gpu, self.vram.reserves[worker.gpu])
            if not msg.error:
                worker.vram = {k: getattr(msg, k) for k in ("reserve_mib", "free_mib", "expert_slots",
                                                            "expert_cache_mib")}
        elif isinstance(msg, InfoReply):
            worker.info = msg.stats
        # Heartbeat: last_seen_s is all it carries

    def _on_ready(self, worker: WorkerState, msg: Ready) -> None:
        wrong = ready_mismatch(worker, msg, self.model_name, self.settings.max_batch, self.settings.max_context)
        if wrong:
            log.error("gpu%d registered with %s; telling it to shut down", worker.gpu, wrong)
            transport.send(self.backend, Shutdown(), worker.identity, flags=zmq.NOBLOCK)
            return
        if worker.generation == msg.generation:  # the same process reconnected (the broker was silent)
            worker.last_seen_s = time.monotonic()
            step = self.inflight.at_stage(worker.gpu)
            if step is not None and step.message is not None:
                log.warning("gpu%d reconnected with a step in flight; sending it again", worker.gpu)
                self._send_worker(worker.gpu, step.message)  # idempotent: same positions, same draws
            return
        if worker.is_ready:
            self._lose(worker, f"gpu{worker.gpu} worker restarted")
        self.pool.mark_ready(worker, msg.generation)
        worker.restoring = self.vram.restore(worker.gpu)  # steps wait until its reserve is back
        log.info("gpu%d ready (generation %s, layers %s, %s)", worker.gpu, msg.generation, msg.layers, msg.device)

    def _on_worker_error(self, worker: WorkerState, msg: WorkerError) -> None:
        log.error("gpu%d: %s", worker.gpu, msg.message)
        step = self.inflight.answered(worker.gpu, msg.step_id)
        if step is not None:  # only that step's requests fail: the other micro-batches go on
            self._abort_step(f"gpu{worker.gpu} failed the step: {msg.message}", step=step)
        if msg.step_id is None:  # not a step: whatever it was, this worker will not answer it otherwise
            self.vram.on_lost(worker.gpu, msg.message)
        if msg.fatal:
            self._lose(worker, f"gpu{worker.gpu} reported a fatal device error")

    def _lose(self, worker: WorkerState, reason: str) -> None:
        """A worker died: everything running had KV state there, so those requests end now; its
        figures go too (only a live worker reports)."""
        worker.generation = None
        worker.info, worker.vram, worker.restoring = {}, {}, False
        self.inflight.clear()
        for seq in list(self.scheduler.running.values()):
            self._fail(seq, f"{reason}; request aborted", status=503)
        self.vram.on_lost(worker.gpu, reason)

    def _restart(self, worker: WorkerState, reason: str) -> None:
        """A worker that missed a deadline: kill it (it is restarted with back-off) and lose it."""
        log.error("%s; restarting it", reason)
        if worker.child:
            worker.child.kill()
        self._lose(worker, reason)

    def _on_vision(self, frames) -> None:
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            self.stats.count("invalid_messages_total")
            log.error("invalid message from the vision worker: %s", e)
            return
        self.vision.on_message(msg)

    def _vision_hooks(self) -> VisionHooks:
        return VisionHooks(
            send=self._send_vision,
            queue_vram=self.vram.internal,
            submit=self.scheduler.submit, reply=self._reply, workers_ready=self.pool.all_ready)

    def _supervise(self, now: float) -> None:
        for worker, reason in self.pool.lost(now):
            self._lose(worker, reason)
        timeout_s = self.settings.broker.step_timeout_s
        for step in self.inflight.overdue(now, timeout_s):
            if step.step_id in self.inflight.steps:  # not cleared by an earlier restart of this turn
                self._abort_step(f"gpu{step.stage} did not answer a step within {timeout_s:g} s", step=step)
                self._restart(self.pool[step.stage], f"gpu{step.stage} missed its step deadline")
        for gpu in self.vram.overdue(now):
            self._restart(self.pool[gpu], f"gpu{gpu} did not answer a VRAM request within "
                                          f"{self.settings.broker.vram_timeout_s:g} s")
        self._cancel_vanished(now)
        for child in self.children:
            status = child.exited()
            if status is not None and child.quick_exits >= MAX_QUICK_EXITS and self.stopping_since is None:
                # an api that cannot start (port taken, bad settings) must not leave a half-alive serve
                log.error("%s exited %d times in a row right after starting; stopping", child.name, child.quick_exits)
                self.exit_status, self.stopping_since = 1, time.monotonic() - self.settings.broker.drain_s
            elif status is not None:
                log.error("%s exited with status %s; restarting", child.name, status)
        if self.stopping_since is None and self.vision:
            self.vision.tick(now)
        if self.stopping_since is None:
            self.stats.count("worker_restarts_total", self.pool.restart_dead())
            for child in self.children:
                child.maybe_restart()

    def _beat(self, now: float) -> None:
        if now >= self.next_beat_s:
            self.next_beat_s = now + self.settings.broker.heartbeat_s
            for w in self.pool:
                if w.is_ready:
                    self._send_worker(w.gpu, Heartbeat())
        # between steps, but a pipeline that never empties asks at most one period late
        if now >= self.next_info_s and (not self.inflight or now >= self.next_info_s + INFO_EVERY_S):
            self.next_info_s = now + INFO_EVERY_S
            self.history.sample(self.stats.counters["generation_tokens_total"],
                                [{**w.info, **w.vram} for w in self.pool])
            for w in self.pool:
                if w.is_ready:
                    self._send_worker(w.gpu, Info())
