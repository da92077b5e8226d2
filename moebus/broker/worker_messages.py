"""What the broker does with a message from the backend: a stage's worker (READY, STEP_REPLY, ERROR,
VRAM_REPLY, INFO_REPLY, HEARTBEAT), one handler per type, or the vision worker (handed to the vision
lifecycle). A reply from an earlier life of a worker, or from one the broker has given up on, is
dropped; a bad or undecodable reply fails the step it concerns, never the loop."""
from __future__ import annotations

import logging
import time

import zmq

from moebus.broker.inflight import Inflight
from moebus.broker.scheduler import Scheduler
from moebus.broker.stats import Stats
from moebus.broker.vision import VisionHooks
from moebus.broker.vram_control import VramControl
from moebus.broker.worker_pool import WorkerPool, WorkerState, ready_mismatch
from moebus.common import transport, wire
from moebus.common.protocol import Info, InfoReply, Ready, Shutdown, StepReply, VramReply, WorkerError

log = logging.getLogger("moebus.broker")
WORKER_VRAM_KEYS = ("reserve_mib", "free_mib", "expert_slots", "expert_cache_mib")  # of a VRAM_REPLY, kept for INFO


class WorkerMessages:
    """The Broker's worker methods (a mixin: the state is the Broker's, named below)."""

    WORKER_HANDLERS = {StepReply: "_on_step_reply", WorkerError: "_on_worker_error", VramReply: "_on_vram_reply",
                       InfoReply: "_on_info_reply"}  # type -> method; a HEARTBEAT needs none

    settings: object
    model_name: str
    backend: zmq.Socket
    pool: WorkerPool
    scheduler: Scheduler
    inflight: Inflight
    vram: VramControl
    stats: Stats
    vision: object | None  # broker/vision.py's VisionLifecycle

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
        handler = self.WORKER_HANDLERS.get(type(msg))
        if handler is not None:  # HEARTBEAT: last_seen_s is all it carries
            getattr(self, handler)(worker, msg)

    def _on_ready(self, worker: WorkerState, msg: Ready) -> None:
        wrong = ready_mismatch(worker, msg, self.model_name, self.settings.max_batch, self.settings.max_context)
        if wrong:
            log.error("gpu%d registered with %s; telling it to shut down", worker.gpu, wrong)
            transport.send(self.backend, Shutdown(), worker.identity, flags=zmq.NOBLOCK)
            return
        if worker.generation == msg.generation:  # the same process reconnected (the broker was silent)
            worker.last_seen_s = time.monotonic()
            for step in self.inflight.all_at_stage(worker.gpu):  # a look-ahead step too, after the one it follows
                if step.message is not None:
                    log.warning("gpu%d reconnected with step %d in flight; sending it again", worker.gpu, step.step_id)
                    self._send_worker(worker.gpu, step.message)  # idempotent: same positions, same draws
            return
        if worker.is_ready:
            self._lose(worker, f"gpu{worker.gpu} worker restarted")
        self.pool.mark_ready(worker, msg.generation)
        if worker.child is not None:
            worker.child.mark_ready()
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

    def _on_vram_reply(self, worker: WorkerState, msg: VramReply) -> None:
        if self.vram.on_reply(worker.gpu, msg):
            worker.restoring = False
            log.info("gpu%d: reserve %s MiB restored", worker.gpu, self.vram.reserves[worker.gpu])
        if not msg.error:
            worker.vram = {k: getattr(msg, k) for k in WORKER_VRAM_KEYS}

    def _on_info_reply(self, worker: WorkerState, msg: InfoReply) -> None:
        worker.info = msg.stats
        if self.vision is not None:  # a cold image start's phases keep the caches' counters
            self.vision.phase_steps.on_worker_info(worker.gpu, msg.stats)

    def _ask_info(self) -> None:
        for w in self.pool:
            if w.is_ready:
                self._send_worker(w.gpu, Info())

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
            submit=self.scheduler.submit, reply=self._reply, workers_ready=self.pool.all_ready,
            worker_info=lambda: [w.info for w in self.pool], decoding=lambda: bool(self.scheduler.running),
            steps_sent=lambda: self.stats.counters["steps_total"] + len(self.inflight), ask_info=self._ask_info)
