"""The broker's VRAM control: client requests, their fan-out to the workers, the deadlines on the
replies, and the reserve each GPU currently holds (so a restarted worker gets it back).

- A query is fanned out at once and answered between steps by each worker: it never pauses decoding.
- A resize waits in a bounded queue; the broker starts it between two decode steps and sends no
  step until every worker has answered (a cache must not shrink under a running step).
- The broker's own stepped hand-back (``between_steps``) goes out at once instead, and steps go on:
  a worker handles one message at a time, in the order they came, and launches a step ahead only
  when that step is its next message, so it applies the resize between two of its own steps. A text
  stream then waits the resize alone, not the pipeline's drain and refill around it.
- A fan-out without every reply by ``timeout_s`` is answered with what came, the silent workers'
  entries marked as errors; the broker restarts those workers (see Broker._supervise).
- ``reserves`` remembers the last reserve each GPU applied; a worker that registers anew is sent
  it (``restore``) before its first step."""
from __future__ import annotations

import itertools
import time

from moebus.broker.vram import VramFanout
from moebus.common.errors import RequestError, ServerBusy
from moebus.common.protocol import Error, Vram, VramReply

RESTORE_PREFIX = "~restore-"
QUERY_PREFIX = "~query-"
_ids = itertools.count(1)


def failed_reply(reason: str) -> VramReply:
    return VramReply(reserve_mib=0, free_mib=0, expert_slots=0, expert_cache_mib=0, error=reason)


class VramControl:
    def __init__(self, num_gpus: int, send_worker, reply_client, max_queue: int, timeout_s: float, observe=None):
        self.num_gpus = num_gpus
        self.send_worker = send_worker  # (gpu, message)
        self.reply_client = reply_client  # (client, message)
        self.observe = observe  # (reserves, aggregated VramReply, query, interim): every answered fan-out
        self.max_queue, self.timeout_s = max_queue, timeout_s
        self.queue: list[VramFanout] = []
        self.inflight: VramFanout | None = None  # a resize: steps wait for it
        self.queries: dict[str, VramFanout] = {}  # fan-out id -> query in flight
        self.reserves: list[float | None] = [None] * num_gpus  # None: the start-up reserve
        self.restoring: dict[int, str] = {}  # gpu -> id of the restore sent to its new worker
        self.restore_started_s = 0.0

    def request(self, client: bytes, reserves: list, query: bool, request_id: str | None) -> None:
        fanout = VramFanout(client, reserves, query, request_id)
        if query:
            self._send(fanout, QUERY_PREFIX)
            return
        if len(self.queue) >= self.max_queue:
            raise ServerBusy(f"server busy: {len(self.queue)} VRAM requests waiting (broker.max_vram_queue)")
        self.queue.append(fanout)

    def internal(self, reserves: list, on_done, interim: bool = False, between_steps: bool = False) -> None:
        """The broker's own resize (the vision hand-back and regrow): queued like a client's, never
        refused for a full queue, and answered to ``on_done(VramReply)`` instead of a client.
        ``interim``: a step of a series whose last request says where it ends (the stepped
        hand-back): observed as such, so the broker does not ask every worker for INFO (which would
        sit ahead of the next decode step) until the series ends. ``between_steps``: sent without
        waiting for the steps in flight, which keep going (see the module doc)."""
        self.queue.append(VramFanout(b"", reserves, False, None, on_done=on_done, interim=interim,
                                     between_steps=between_steps))

    def steps_wait(self, pipeline_empty: bool) -> bool:
        """Before a new step: start the next resize if it may go now (the pipeline is empty, or the
        workers apply it between their own steps); True while one holds new steps back."""
        if self.inflight is None and self.queue and (pipeline_empty or self.queue[0].between_steps):
            self.start_next()
        if self.inflight is not None:
            return not self.inflight.between_steps
        return bool(self.queue)

    def start_next(self) -> bool:
        """Between two steps: start the next resize; True when one is in flight (no step now)."""
        if self.inflight is None and self.queue:
            self.inflight = self.queue.pop(0)
            self._send(self.inflight, "~resize-")
        return self.inflight is not None

    def _send(self, fanout: VramFanout, prefix: str) -> None:
        fanout.fanout_id, fanout.started_s = f"{prefix}{next(_ids)}", time.monotonic()
        if fanout.query:
            self.queries[fanout.fanout_id] = fanout
        for gpu, reserve in enumerate(fanout.reserves):
            if not self.send_worker(gpu, Vram(id=fanout.fanout_id, reserve_mib=reserve, query=fanout.query)):
                fanout.replies[gpu] = failed_reply(f"gpu{gpu} is not ready")
        if fanout.complete(self.num_gpus):
            self._answer(fanout)

    def restore(self, gpu: int) -> bool:
        """A fresh worker of ``gpu``: send it the GPU's current reserve; True if one was sent."""
        if self.reserves[gpu] is None:
            return False
        self.restoring[gpu] = f"{RESTORE_PREFIX}{next(_ids)}"
        self.restore_started_s = time.monotonic()
        return self.send_worker(gpu, Vram(id=self.restoring[gpu], reserve_mib=self.reserves[gpu]))

    def on_reply(self, gpu: int, msg: VramReply) -> bool:
        """A worker's reply; True when it was a restore (the worker may now take steps)."""
        if msg.id is not None and self.restoring.get(gpu) == msg.id:
            del self.restoring[gpu]
            return True
        fanout = self.queries.get(msg.id) if msg.id in self.queries else self.inflight
        if fanout is None or (msg.id is not None and getattr(fanout, "fanout_id", None) != msg.id):
            return False  # a late reply of a fan-out that timed out
        if gpu not in fanout.replies:
            fanout.replies[gpu] = msg
            if not msg.error and not fanout.query:
                self.reserves[gpu] = fanout.reserves[gpu]
        if fanout.complete(self.num_gpus):
            self._answer(fanout)
        return False

    def on_lost(self, gpu: int, reason: str) -> None:
        """A worker died: it owes no reply any more; a restore it owed is moot (the next one restores)."""
        self.restoring.pop(gpu, None)
        for fanout in [self.inflight, *self.queries.values()]:
            if fanout is not None and gpu not in fanout.replies:
                fanout.replies[gpu] = failed_reply(reason)
                if fanout.complete(self.num_gpus):
                    self._answer(fanout)

    def overdue(self, now: float) -> list[int]:
        """GPUs whose workers let a fan-out (or a restore) pass its deadline; their entries are failed."""
        late = set(self.restoring) if self.restoring and now - self.restore_started_s > self.timeout_s else set()
        for fanout in [self.inflight, *self.queries.values()]:
            if fanout is not None and now - fanout.started_s > self.timeout_s:
                fanout.timed_out = True
                late |= {g for g in range(self.num_gpus) if g not in fanout.replies}
        return sorted(late)

    def _answer(self, fanout: VramFanout) -> None:
        if fanout is self.inflight:
            self.inflight = None
        self.queries.pop(getattr(fanout, "fanout_id", None), None)
        reply = fanout.aggregate()
        if self.observe is not None:
            self.observe(fanout.reserves, reply, fanout.query, fanout.interim)
        if fanout.on_done is not None:
            fanout.on_done(reply)
            return
        if reply.error and all(r.error for r in fanout.replies.values()):
            self.reply_client(fanout.client, Error(id=fanout.request_id, message=reply.error, param="reserve_mib",
                                                   status=400 if not fanout.timed_out else 503))
        else:
            self.reply_client(fanout.client, reply)

    def fail_all(self, reason: str) -> None:
        """Shutting down: every waiting request gets its answer."""
        for fanout in self.queue:
            self.reply_client(fanout.client, Error(id=fanout.request_id, message=reason, status=503,
                                                   type="service_unavailable"))
        self.queue.clear()


def check_not_elastic(elastic: bool, query: bool) -> None:
    if not elastic and not query:
        raise RequestError("the expert cache is not elastic (vram_elastic is false)", param="reserve_mib")
