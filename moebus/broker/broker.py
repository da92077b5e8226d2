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
import math
import signal
import time

import zmq

from moebus.broker.admission import detokenize, tokenize
from moebus.broker.clients import ClientTable
from moebus.broker.history import History
from moebus.broker.inflight import Inflight, InflightStep
from moebus.broker.scheduler import Scheduler
from moebus.broker.sequence import Sequence
from moebus.broker.stats import Stats
from moebus.broker.tokenize_pool import TokenizePool
from moebus.broker.vision import VisionHooks
from moebus.broker.vision_requests import ImageRequest, step_embeds
from moebus.broker.vram import per_gpu_reserves
from moebus.broker.vram_control import VramControl, check_not_elastic
from moebus.broker.worker_pool import WorkerPool, WorkerState, ready_mismatch
from moebus.common import transport, wire
from moebus.common.errors import RequestError, ServerBusy, Unavailable
from moebus.common.model_config import ModelConfig
from moebus.common.protocol import (Cancel, Detokenize, Error, Final, Generate, Heartbeat, Info, InfoReply, Partial,
                                    Ping, Pong, Ready, Shutdown, Step, StepReply, Tokenize, Vram, VramReply,
                                    WorkerError)
from moebus.common.tokenizer import TextTokenizer

log = logging.getLogger("moebus.broker")
POLL_MS = 50
INFO_EVERY_S = 2.0
MAX_DRAIN = 256  # messages handled per socket per loop turn, so neither side starves the other
MAX_QUICK_EXITS = 5  # of a supervised child (the api) before serve gives up and exits non-zero
FRONTEND_SNDHWM = 100_000  # replies queued per client before a send fails (then its requests fail)


def finite_logprob(value) -> float:
    """A logprob fit for JSON: -inf (a token the sampler could not have drawn) and NaN become -9999,
    OpenAI's figure for "as unlikely as it gets"."""
    value = float(value)
    return value if math.isfinite(value) else -9999.0


class Broker:
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

    def _abort_step(self, reason: str, status: int = 500, step: InflightStep | None = None) -> None:
        """``step`` (default: every step in flight) cannot complete: its requests fail."""
        steps = self.inflight.clear() if step is None else self.inflight.discard(step)
        for seq in [seq for s in steps for seq in s.plan.seqs]:
            self._fail(seq, f"{reason}; request aborted", status=status)

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

    def _reply(self, client: bytes, message) -> bool:
        """Send to a client; False when it cannot take it (gone, or its queue full): then its
        requests fail here rather than wait for replies that would never reach it."""
        try:
            transport.send(self.frontend, message, client, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH (gone) or EAGAIN (not reading)
            self.stats.count("undeliverable_replies_total")
            log.warning("a reply to client %r could not be delivered (%s); its requests are cancelled",
                        client[:16], e.strerror)
            self._drop_client(client)
            return False

    def _drop_client(self, client: bytes) -> None:
        for seq in self._requests_of({client}):
            self.scheduler.remove(seq)
            self.stats.count("requests_cancelled_total")
        self.cancelled_while_tokenizing.update(i for i, c in self.tokenize.pending.items() if c == client)
        self.clients.last_seen_s.pop(client, None)

    def _requests_of(self, clients: set[bytes]) -> list[Sequence]:
        return [s for s in list(self.scheduler.running.values()) + list(self.scheduler.waiting) if s.client in clients]

    def _send_worker(self, gpu: int, message) -> bool:
        """Send to a worker; False when it is not connected (it is then treated as lost)."""
        try:
            transport.send(self.backend, message, self.pool[gpu].identity, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            log.error("gpu%d cannot be reached (%s)", gpu, e.strerror)
            return False

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
        if isinstance(msg, Generate):
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
        elif isinstance(msg, Cancel):
            if self.vision and self.vision.cancel(msg.id, client):
                return
            seq = self.scheduler.find(msg.id)
            if seq is not None and seq.client == client:
                self._finish(seq, "cancelled")
            elif self.tokenize.pending.get(msg.id) == client:
                self.cancelled_while_tokenizing.add(msg.id)
        elif isinstance(msg, Vram):
            reserves = per_gpu_reserves(msg, len(self.pool))
            check_not_elastic(self.settings.vram_elastic, msg.query)
            self.vram.request(client, reserves, msg.query, msg.id)
        elif isinstance(msg, Info):
            self._reply(client, InfoReply(id=msg.id, stats=self.info()))
        elif isinstance(msg, Ping):
            self._reply(client, Pong(id=msg.id, ready=self.pool.all_ready()))
        elif isinstance(msg, Heartbeat):
            pass  # liveness only (seen above)
        elif isinstance(msg, Tokenize):  # off the loop, as a GENERATE's prompt: it may be long
            self.tokenize.submit(client, msg, lambda m, _c, tok, _vocab, max_context: tokenize(m, tok, max_context))
        elif isinstance(msg, Detokenize):
            self.tokenize.submit(client, msg, lambda m, _c, tok, vocab_size, _ctx: detokenize(m, tok, vocab_size))
        else:
            raise RequestError(f"unexpected message type {msg.TYPE.decode()}")

    def _on_vram_answer(self, reserves: list, reply: VramReply, query: bool) -> None:
        self.history.vram_reply(reserves, reply, query=query)
        self.next_info_s = 0.0  # the residency changed with the size: ask INFO on the next turn

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
                continue
            if msg.id in self.cancelled_while_tokenizing:
                self.cancelled_while_tokenizing.discard(msg.id)
                self._reply(client, Final(id=msg.id, finish_reason="cancelled", prompt_tokens=0, completion_tokens=0))
                self.stats.count("requests_cancelled_total")
                continue
            error = item.error
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
                    continue
                except RequestError as e:
                    error = e
            self._reply(client, Error(id=msg.id, status=error.http_status, **error.to_dict()))

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

    def _send_vision(self, message) -> bool:
        """To the vision worker; False while it is not connected (a worker just forked, or gone: the
        lifecycle's heartbeat deadline decides which)."""
        try:
            transport.send(self.backend, message, b"vision", flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

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

    def _cancel_vanished(self, now: float) -> None:
        holders = {s.client for s in list(self.scheduler.running.values()) + list(self.scheduler.waiting)}
        for client in self.clients.vanished(holders, now):
            log.warning("client %r silent for over %.0f s: its requests are cancelled", client[:16],
                        self.clients.timeout_s)
            self._drop_client(client)

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

    # -- steps ------------------------------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        if not self.pool.all_ready():
            return
        self._send_ready_steps()  # to a stage that an aborted step left free (and still alive: ready)
        if self.vram.is_pending():  # no new step: the resize starts once every step in flight is back
            if not self.inflight:
                self.vram.start_next()
            return
        if not self.inflight.can_start():
            return
        try:
            plan = self.scheduler.plan(self.inflight.busy_ids(), self.inflight.num_groups)
        except Exception:  # noqa: BLE001 - which request broke the plan is unknown: the running ones fail
            log.exception("planning a step failed")
            self.stats.count("internal_errors_total")
            for seq in list(self.scheduler.running.values()):
                self._fail(seq, "internal error while planning a step; request aborted", status=500)
            return
        if plan is None:
            return
        if self.inflight:
            self.stats.count("pipelined_steps_total")
        self._send_step(self.inflight.start(next(self.step_ids), plan, now), None)

    def _send_step(self, step: InflightStep, hidden) -> None:
        plan = step.plan
        embeds, embed_rows = step_embeds(plan.seqs, plan.starts, plan.lengths) if step.stage == 0 else (None, None)
        rules = (plan.logit_rules or {}) if step.stage == len(self.pool) - 1 else {}
        step.message = Step(step_id=step.step_id, top_logprobs=plan.top_logprobs, slots=plan.slots,
                            logprob_rows=plan.logprob_rows if plan.top_logprobs else None,
                            starts=plan.starts, lengths=plan.lengths, tokens=plan.tokens if step.stage == 0 else None,
                            hidden=hidden, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p, u=plan.u,
                            embeds=embeds, embed_rows=embed_rows, **rules)
        step.sent_s = time.monotonic()
        if not self._send_worker(step.stage, step.message):
            self._lose(self.pool[step.stage], f"gpu{step.stage} is not connected")

    def _on_step_reply(self, worker: WorkerState, msg: StepReply) -> None:
        step = self.inflight.answered(worker.gpu, msg.step_id)
        if step is None:
            self.stats.count("invalid_messages_total")
            return  # a stale reply (its step was aborted)
        step.compute_s += msg.compute_s
        if step.stage + 1 < len(self.pool):
            self.inflight.park(step, msg.hidden)
            self._send_ready_steps()
            return
        if msg.tokens is None or msg.logprobs is None or len(msg.tokens) != len(step.plan.seqs):
            self._abort_step(f"gpu{worker.gpu} answered the step without one token per sequence", step=step)
            return
        self.inflight.discard(step)
        self._send_ready_steps()  # the last stage is free: the next micro-batch goes on before tokens stream
        now = time.monotonic()
        self.stats.count("steps_total")
        self.stats.observe("step_seconds", now - step.started_s)
        self.stats.observe("step_compute_seconds", step.compute_s)
        self.scheduler.advance(step.plan)
        top_row = {int(r): j for j, r in enumerate(step.plan.logprob_rows)}  # the reply's top_* rows
        if msg.top_ids is None or len(msg.top_ids) != len(top_row) or len(msg.top_logprobs) != len(top_row):
            top_row = {}  # a reply that disagrees about who asked: no top logprobs rather than wrong ones
        for i, (seq, samples) in enumerate(zip(step.plan.seqs, step.plan.samples)):
            if samples and self.scheduler.running.get(seq.id) is seq:
                self._emit(seq, int(msg.tokens[i]), finite_logprob(msg.logprobs[i]), msg, top_row.get(i), now)

    def _send_ready_steps(self) -> None:
        """Send every waiting step whose next stage is free (in the order the steps started)."""
        while (step := self.inflight.next_ready()) is not None:
            hidden, step.hidden = step.hidden, None
            self._send_step(step, hidden)

    def _emit(self, seq: Sequence, token: int, logprob: float, msg: StepReply, row: int | None, now: float) -> None:
        previous_s = seq.last_token_s
        text = seq.accept(token, now)
        self.stats.count("generation_tokens_total")
        if previous_s is None:
            self.stats.count("prompt_tokens_total", len(seq.prompt))
            self.stats.observe("time_to_first_token_seconds", now - seq.arrived_s)
        else:
            self.stats.observe("inter_token_latency_seconds", now - previous_s)
        top = texts = top_texts = None
        if seq.sampling.logprobs and msg.top_ids is not None and row is not None:
            n = seq.sampling.logprobs
            top = [[(int(t), finite_logprob(lp)) for t, lp in zip(msg.top_ids[row][:n], msg.top_logprobs[row][:n])]]
            texts, top_texts = [self._token_text(token)], [[self._token_text(t) for t, _ in top[0]]]
        self._reply(seq.client, Partial(id=seq.id, tokens=[token], text=text, logprobs=[logprob], top_logprobs=top,
                                        token_texts=texts, top_texts=top_texts,
                                        reasoning_open=seq.reasoning_open if len(seq.generated) == 1 else None))
        if seq.finish_reason:
            self._finish(seq, seq.finish_reason)

    def _token_text(self, token: int) -> str:
        """One token on its own, special tokens included (a byte-level piece of a character: U+FFFD)."""
        return self.tokenizer.tokenizer.decode([token], skip_special_tokens=False)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self._reply(seq.client, Final(id=seq.id, finish_reason=reason, prompt_tokens=len(seq.prompt),
                                      completion_tokens=len(seq.generated)))
        self.stats.count("requests_cancelled_total" if reason == "cancelled" else "requests_finished_total")
        self.stats.observe("e2e_request_latency_seconds", time.monotonic() - seq.arrived_s)

    def _fail(self, seq: Sequence, message: str, status: int = 500) -> None:
        self.scheduler.remove(seq)
        self.stats.count("requests_failed_total")
        kind = "service_unavailable" if status == 503 else "server_error"
        self._reply(seq.client, Error(id=seq.id, message=message, type=kind, status=status))
