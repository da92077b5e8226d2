"""The broker's watch over its peers, once per loop turn: purge dead workers (process exit, missed
heartbeats, a missed step or VRAM deadline), cancel the requests of vanished clients, restart dead
children, and send the heartbeats and INFO polls that the workers' liveness and the dashboard need.
A lost worker takes every running request with it (their KV state was there)."""
from __future__ import annotations

import logging
import time

from moebus.broker.clients import ClientTable
from moebus.broker.history import History
from moebus.broker.inflight import Inflight
from moebus.broker.scheduler import Scheduler
from moebus.broker.stats import Stats
from moebus.broker.vram_control import VramControl
from moebus.broker.worker_pool import WorkerPool, WorkerState
from moebus.common.protocol import Heartbeat, Info

log = logging.getLogger("moebus.broker")
INFO_EVERY_S = 2.0
MAX_QUICK_EXITS = 5  # exits of a child before it was ready, in a row, before serve gives up and exits non-zero


class Supervision:
    """The Broker's liveness methods (a mixin: the state is the Broker's, named below)."""

    settings: object
    children: list
    pool: WorkerPool
    scheduler: Scheduler
    inflight: Inflight
    vram: VramControl
    clients: ClientTable
    history: History
    stats: Stats
    vision: object | None  # broker/vision.py's VisionLifecycle
    stopping_since: float | None
    exit_status: int
    fatal_error: str | None
    last_turn_s: float
    next_beat_s: float
    next_info_s: float

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

    def _supervise(self, now: float) -> None:
        self._purge_dead_workers(now)
        self._cancel_vanished(now)
        self._watch_children()
        if self.stopping_since is None and self.vision:
            self.vision.tick(now)
            self._cannot_start(self.vision.zygote)
        if self.stopping_since is None:
            self.stats.count("worker_restarts_total", self.pool.restart_dead())
            for child in self.children:
                child.maybe_restart()

    def _purge_dead_workers(self, now: float) -> None:
        for worker, reason in self.pool.lost(now):
            self._cannot_start(worker.child)
            self._lose(worker, reason)
        timeout_s = self.settings.broker.step_timeout_s
        for step in self.inflight.overdue(now, timeout_s):
            if step.step_id in self.inflight.steps:  # not cleared by an earlier restart of this turn
                self._abort_step(f"gpu{step.stage} did not answer a step within {timeout_s:g} s", step=step)
                self._restart(self.pool[step.stage], f"gpu{step.stage} missed its step deadline")
        for gpu in self.vram.overdue(now):
            self._restart(self.pool[gpu], f"gpu{gpu} did not answer a VRAM request within "
                                          f"{self.settings.broker.vram_timeout_s:g} s")

    def _watch_children(self) -> None:
        for child in self.children:
            status = child.exited()
            if status is not None and not self._cannot_start(child):
                log.error("%s exited with status %s; restarting", child.name, status)

    def _cannot_start(self, child) -> bool:
        """A child that exited before it was ready, saying why (a setting, a checkpoint the loader
        refuses), or exiting right after each start: no restart can succeed, so the whole start ends
        with its reason (run_broker raises it) rather than restarting it for ever."""
        if child is None or self.stopping_since is not None:
            return False
        if child.start_error:
            reason = f"{child.name} cannot start: {child.start_error}"
        elif child.quick_exits >= MAX_QUICK_EXITS:
            reason = f"{child.name} exited {child.quick_exits} times in a row before it was ready"
        else:
            return False
        log.error("%s; stopping", reason)
        self.fatal_error, self.exit_status = reason, 2
        self.stopping_since = time.monotonic() - self.settings.broker.drain_s
        return True

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
