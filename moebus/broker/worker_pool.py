"""The broker's view of its GPU workers: which stage each serves, its current generation (a new
one per process start), liveness from heartbeats, and the child process when the broker spawned
it. A worker that misses ``liveness`` beats, or whose process exits, is dead: its generation is
forgotten, so late replies from that life are dropped."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from moebus.broker.children import Child

log = logging.getLogger("moebus.broker")


@dataclass
class WorkerState:
    gpu: int
    layers: range
    child: Child | None = None  # None: a worker that joins from elsewhere (moebus worker --connect)
    generation: str | None = None
    last_seen_s: float = 0.0
    info: dict = field(default_factory=dict)
    vram: dict = field(default_factory=dict)
    restoring: bool = False  # a new worker being sent its GPU's current reserve: no step yet

    @property
    def identity(self) -> bytes:
        return f"gpu{self.gpu}".encode()

    @property
    def is_ready(self) -> bool:
        return self.generation is not None


class WorkerPool:
    def __init__(self, layer_ranges: list[range], children: list[Child | None], heartbeat_s: float,
                 liveness: int):
        self.workers = [WorkerState(i, r, c) for i, (r, c) in enumerate(zip(layer_ranges, children))]
        self.timeout_s = heartbeat_s * liveness

    def __iter__(self):
        return iter(self.workers)

    def __len__(self):
        return len(self.workers)

    def __getitem__(self, stage: int) -> WorkerState:
        return self.workers[stage]

    def by_identity(self, identity: bytes) -> WorkerState | None:
        name = identity.decode(errors="replace")
        if name.startswith("gpu") and name[3:].isdigit() and int(name[3:]) < len(self.workers):
            return self.workers[int(name[3:])]
        return None

    def all_ready(self) -> bool:
        return all(w.is_ready and not w.restoring for w in self.workers)

    def start(self) -> None:
        for w in self.workers:
            if w.child:
                w.child.start()

    def lost(self, now: float) -> list[tuple[WorkerState, str]]:
        """Workers found dead since the last call (process exit or missed heartbeats), marked dead."""
        found = []
        for w in self.workers:
            status = w.child.exited() if w.child else None
            if status is not None:
                found.append((w, f"gpu{w.gpu} worker exited with status {status}"))
            elif w.is_ready and now - w.last_seen_s > self.timeout_s:
                found.append((w, f"gpu{w.gpu} worker missed heartbeats for {now - w.last_seen_s:.1f} s"))
                if w.child:
                    w.child.kill()
                    w.child.exited()
        for w, reason in found:
            log.error("%s", reason)
            w.generation = None
        return found

    def restart_dead(self) -> int:
        return sum(1 for w in self.workers if w.child and w.child.maybe_restart())

    def stop(self) -> None:
        for w in self.workers:
            if w.child:
                w.child.stop()

    def mark_ready(self, w: WorkerState, generation: str) -> None:
        w.generation = generation
        w.last_seen_s = time.monotonic()


def ready_mismatch(worker: WorkerState, msg, model: str, max_batch: int, max_context: int) -> str | None:
    """Why this READY cannot serve this stage (a remote worker of another model or other limits)."""
    expected = {"layers": (worker.layers.start, worker.layers.stop), "model": model, "max_batch": max_batch,
                "max_context": max_context}
    got = {"layers": tuple(msg.layers), "model": msg.model, "max_batch": msg.max_batch, "max_context": msg.max_context}
    wrong = [f"{k} {got[k]!r} (expected {v!r})" for k, v in expected.items() if got[k] != v]
    return ", ".join(wrong) or None
