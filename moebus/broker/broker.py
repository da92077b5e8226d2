"""The broker: one process, one poll loop. It owns the request queue and scheduler, sequence state,
the tokenizer, worker liveness, VRAM fan-out and all metrics state. Clients talk to the frontend
ROUTER, workers to the backend ROUTER; one decode step at a time travels gpu0 -> gpu1 -> ... and
the last stage's token ids come back here to be streamed."""
from __future__ import annotations

import itertools
import logging
import signal
import time
from collections import deque
from dataclasses import dataclass

import zmq

from moebus.broker.admission import make_sequence
from moebus.broker.scheduler import PlannedStep, Scheduler
from moebus.broker.sequence import Sequence
from moebus.broker.stats import Stats
from moebus.broker.vision import VisionHooks, has_images, step_embeds
from moebus.broker.vram import VramFanout, per_gpu_reserves
from moebus.broker.worker_pool import WorkerPool, WorkerState
from moebus.common import transport, wire
from moebus.common.errors import RequestError, Unavailable
from moebus.common.model_config import ModelConfig
from moebus.common.protocol import (Cancel, Error, Final, Generate, Heartbeat, Info, InfoReply, Partial, Ping,
                                    Pong, Ready, Shutdown, Step, StepReply, Vram, VramReply, WorkerError)
from moebus.common.tokenizer import TextTokenizer

log = logging.getLogger("moebus.broker")
POLL_MS = 50
INFO_EVERY_S = 2.0
MAX_DRAIN = 256  # messages handled per socket per loop turn, so neither side starves the other


@dataclass
class InflightStep:
    step_id: int
    plan: PlannedStep
    stage: int
    started_s: float
    compute_s: float = 0.0  # summed over the stages


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
        self.ctx = zmq.Context.instance()
        keys = settings.broker.curve_public_key, settings.broker.curve_secret_key
        self.frontend = transport.make_socket(self.ctx, zmq.ROUTER, max_bytes=settings.max_request_bytes)
        transport.secure_bind(self.frontend, settings.broker.frontend, *keys)
        self.backend = transport.make_socket(self.ctx, zmq.ROUTER)
        # a restarted worker (a vision worker forks in milliseconds) may connect before the broker has
        # seen its predecessor's connection close: the new connection takes the identity over
        self.backend.setsockopt(zmq.ROUTER_HANDOVER, 1)
        transport.secure_bind(self.backend, backend_address, *keys)
        self.inflight: InflightStep | None = None
        self.vram_queue: deque[VramFanout] = deque()
        self.vram_inflight: VramFanout | None = None
        self.step_ids = itertools.count(1)
        self.stopping_since: float | None = None
        self.next_beat_s = self.next_info_s = 0.0
        self.vision = vision(self._vision_hooks(), self.stats) if vision else None

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        self.pool.start()
        if self.vision:
            self.vision.start()
        for child in self.children:
            child.start()
        try:
            while not self._drained():
                events = dict(poller.poll(POLL_MS))
                if self.frontend in events:
                    self._drain(self.frontend, self._on_client)
                if self.backend in events:
                    self._drain(self.backend, self._on_worker)
                now = time.monotonic()
                self._supervise(now)
                self._beat(now)
                self._dispatch(now)
        finally:
            self._shutdown()
        return 0

    def _on_signal(self, signum, _frame) -> None:
        if self.stopping_since is None:
            log.info("signal %d: draining (no new requests), then stopping", signum)
            self.stopping_since = time.monotonic()

    def _drained(self) -> bool:
        if self.stopping_since is None:
            return False
        timed_out = time.monotonic() - self.stopping_since > self.settings.broker.drain_s
        if timed_out or not self.pool.all_ready():
            for seq in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
                self._fail(seq, "server shutting down", status=503)
        return not self.scheduler.running and not self.scheduler.waiting and self.inflight is None

    def _shutdown(self) -> None:
        for w in self.pool:
            if w.is_ready:
                transport.send(self.backend, Shutdown(), w.identity)
        if self.vision:
            self.vision.stop()
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

    def _reply(self, client: bytes, message) -> None:
        transport.send(self.frontend, message, client)

    def _on_client(self, client: bytes, frames) -> None:
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
            if self.scheduler.find(msg.id) or (self.vision and self.vision.find(msg.id)):
                raise RequestError(f"request id {msg.id!r} is already in use", param="id")
            if self.vision and has_images(msg):  # waits in the vision lifecycle for its embeddings
                self.vision.admit(msg, client, self.tokenizer, self.config.vocab_size, self.settings.max_context)
                self.stats.count("requests_total")
                return
            if msg.images:
                raise RequestError("model has no vision: image inputs are not supported", param="images",
                                   code="model_has_no_vision")
            seq = make_sequence(msg, client, self.tokenizer, self.config.vocab_size, self.settings.max_context)
            self.scheduler.submit(seq)
            self.stats.count("requests_total")
        elif isinstance(msg, Cancel):
            if self.vision and self.vision.cancel(msg.id, client):
                return
            seq = self.scheduler.find(msg.id)
            if seq is not None and seq.client == client:
                self._finish(seq, "cancelled")
        elif isinstance(msg, Vram):
            reserves = per_gpu_reserves(msg, len(self.pool))
            if not self.settings.vram_elastic and not msg.query:
                raise RequestError("the expert cache is not elastic (vram_elastic is false)", param="reserve_mib")
            self.vram_queue.append(VramFanout(client, reserves, msg.query, msg.id))
        elif isinstance(msg, Info):
            self._reply(client, InfoReply(id=msg.id, stats=self.info()))
        elif isinstance(msg, Ping):
            self._reply(client, Pong(id=msg.id, ready=self.pool.all_ready()))
        else:
            raise RequestError(f"unexpected message type {msg.TYPE.decode()}")

    def info(self) -> dict:
        return {"ready": self.pool.all_ready(), "model": self.model_name,
                "requests_running": len(self.scheduler.running), "requests_waiting": len(self.scheduler.waiting),
                "max_context": self.settings.max_context, "vocab_size": self.config.vocab_size,
                **self.stats.to_dict(), **(self.vision.info() if self.vision else {"vision_loaded": 0}),
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
            log.error("invalid message from worker %r: %s", identity, e)
            return
        if worker is None:
            log.error("message from unknown worker %r dropped", identity)
            return
        if isinstance(msg, Ready):
            self._on_ready(worker, msg)
            return
        if getattr(msg, "generation", worker.generation) != worker.generation:
            return  # a reply from an earlier life of this worker: its state is gone
        worker.last_seen_s = time.monotonic()
        if isinstance(msg, StepReply):
            self._on_step_reply(worker, msg)
        elif isinstance(msg, WorkerError):
            self._on_worker_error(worker, msg)
        elif isinstance(msg, VramReply):
            self._on_vram_reply(worker, msg)
        elif isinstance(msg, InfoReply):
            worker.info = msg.stats
        # Heartbeat: last_seen_s is all it carries

    def _on_ready(self, worker: WorkerState, msg: Ready) -> None:
        expected = (worker.layers.start, worker.layers.stop)
        if tuple(msg.layers) != expected:
            log.error("gpu%d registered layers %s, expected %s; telling it to shut down", worker.gpu,
                      msg.layers, expected)
            transport.send(self.backend, Shutdown(), worker.identity)
            return
        if worker.is_ready and worker.generation != msg.generation:
            self._lose(worker, f"gpu{worker.gpu} worker restarted")
        self.pool.mark_ready(worker, msg.generation)
        log.info("gpu%d ready (generation %s, layers %s, %s)", worker.gpu, msg.generation, msg.layers, msg.device)

    def _on_worker_error(self, worker: WorkerState, msg: WorkerError) -> None:
        log.error("gpu%d: %s", worker.gpu, msg.message)
        if self.inflight is not None and msg.step_id == self.inflight.step_id:
            for seq in self.inflight.plan.seqs:
                self._fail(seq, f"gpu{worker.gpu} failed the step: {msg.message}", status=500)
            self.inflight = None
        if msg.fatal:
            self._lose(worker, f"gpu{worker.gpu} reported a fatal device error")

    def _lose(self, worker: WorkerState, reason: str) -> None:
        """A worker died: everything running had KV state there, so those requests end now."""
        worker.generation = None
        self.inflight = None
        for seq in list(self.scheduler.running.values()):
            self._fail(seq, f"{reason}; request aborted", status=503)
        if self.vram_inflight is not None and worker.gpu not in self.vram_inflight.replies:
            self._on_vram_reply(worker, VramReply(reserve_mib=0, free_mib=0, expert_slots=0, expert_cache_mib=0,
                                                  error=reason))

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
            send=lambda message: transport.send(self.backend, message, b"vision"),
            queue_vram=lambda reserves, on_done: self.vram_queue.append(
                VramFanout(b"", reserves, query=False, on_done=on_done)),
            submit=self.scheduler.submit, reply=self._reply, workers_ready=self.pool.all_ready)

    def _supervise(self, now: float) -> None:
        for worker, reason in self.pool.lost(now):
            self._lose(worker, reason)
        for child in self.children:
            status = child.exited()
            if status is not None:
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
                    transport.send(self.backend, Heartbeat(), w.identity)
        if now >= self.next_info_s and self.inflight is None:
            self.next_info_s = now + INFO_EVERY_S
            for w in self.pool:
                if w.is_ready:
                    transport.send(self.backend, Info(), w.identity)

    # -- steps ------------------------------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        if self.inflight is not None or self.vram_inflight is not None or not self.pool.all_ready():
            return
        if self.vram_queue:  # between two decode steps: apply the reserve, then carry on
            self._start_vram(self.vram_queue.popleft())
            return
        plan = self.scheduler.plan()
        if plan is None:
            return
        self.inflight = InflightStep(next(self.step_ids), plan, stage=0, started_s=now)
        self._send_step(None)

    def _send_step(self, hidden) -> None:
        step, plan = self.inflight, self.inflight.plan
        embeds, embed_rows = step_embeds(plan.seqs, plan.starts, plan.lengths) if step.stage == 0 else (None, None)
        message = Step(step_id=step.step_id, top_logprobs=plan.top_logprobs, slots=plan.slots, starts=plan.starts,
                       lengths=plan.lengths, tokens=plan.tokens if step.stage == 0 else None, hidden=hidden,
                       temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p, u=plan.u,
                       embeds=embeds, embed_rows=embed_rows)
        transport.send(self.backend, message, self.pool[step.stage].identity)

    def _on_step_reply(self, worker: WorkerState, msg: StepReply) -> None:
        step = self.inflight
        if step is None or msg.step_id != step.step_id or worker.gpu != step.stage:
            self.stats.count("invalid_messages_total")
            return  # a stale reply (its step was aborted)
        step.compute_s += msg.compute_s
        if step.stage + 1 < len(self.pool):
            step.stage += 1
            self._send_step(msg.hidden)
            return
        self.inflight = None
        now = time.monotonic()
        self.stats.count("steps_total")
        self.stats.observe("step_seconds", now - step.started_s)
        self.stats.observe("step_compute_seconds", step.compute_s)
        self.scheduler.advance(step.plan)
        for i, (seq, samples) in enumerate(zip(step.plan.seqs, step.plan.samples)):
            if samples and self.scheduler.running.get(seq.id) is seq:
                self._emit(seq, int(msg.tokens[i]), float(msg.logprobs[i]), msg, i, now)

    def _emit(self, seq: Sequence, token: int, logprob: float, msg: StepReply, row: int, now: float) -> None:
        previous_s = seq.last_token_s
        text = seq.accept(token, now)
        self.stats.count("generation_tokens_total")
        if previous_s is None:
            self.stats.count("prompt_tokens_total", len(seq.prompt))
            self.stats.observe("time_to_first_token_seconds", now - seq.arrived_s)
        else:
            self.stats.observe("inter_token_latency_seconds", now - previous_s)
        top = texts = top_texts = None
        if seq.sampling.logprobs and msg.top_ids is not None:
            n = seq.sampling.logprobs
            top = [[(int(t), float(lp)) for t, lp in zip(msg.top_ids[row][:n], msg.top_logprobs[row][:n])]]
            texts, top_texts = [self._token_text(token)], [[self._token_text(t) for t, _ in top[0]]]
        self._reply(seq.client, Partial(id=seq.id, tokens=[token], text=text, logprobs=[logprob], top_logprobs=top,
                                        token_texts=texts, top_texts=top_texts))
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

    # -- VRAM -------------------------------------------------------------------------------------

    def _start_vram(self, fanout: VramFanout) -> None:
        self.vram_inflight = fanout
        for w, reserve in zip(self.pool, fanout.reserves):
            transport.send(self.backend, Vram(reserve_mib=reserve, query=fanout.query), w.identity)

    def _on_vram_reply(self, worker: WorkerState, msg: VramReply) -> None:
        fanout = self.vram_inflight
        if fanout is None:
            return
        fanout.replies[worker.gpu] = msg
        if not msg.error:
            worker.vram = {k: getattr(msg, k) for k in ("reserve_mib", "free_mib", "expert_slots", "expert_cache_mib")}
        if fanout.complete(len(self.pool)):
            self.vram_inflight = None
            reply = fanout.aggregate()
            if fanout.on_done is not None:  # the vision lifecycle's own hand-back or regrow
                fanout.on_done(reply)
                return
            if reply.error and all(r.error for r in fanout.replies.values()):
                self._reply(fanout.client, Error(id=fanout.request_id, message=reply.error, param="reserve_mib", status=400))
            else:
                self._reply(fanout.client, reply)
