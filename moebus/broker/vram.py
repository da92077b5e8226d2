"""VRAM requests: validate a client's per-GPU reserves, fan one VRAM message out to each worker,
and aggregate their replies into one line of comma lists, one value per cache in worker order:
``reserve_mib=1700,600 free_mib=1712,640 expert_slots=6000,8005 expert_cache_mib=56640,75568``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from moebus.common.errors import RequestError
from moebus.common.protocol import Vram, VramReply

FIELDS = ("reserve_mib", "free_mib", "expert_slots", "expert_cache_mib")


def per_gpu_reserves(request: Vram, num_gpus: int) -> list[float | None]:
    """One reserve per GPU (None: back to the start-up size). Raises RequestError, changing nothing."""
    values = request.reserve_mib
    if values is None:
        return [None] * num_gpus
    if not isinstance(values, list):
        values = [values]
    if len(values) > num_gpus:
        raise RequestError(f"{len(values)} reserves given for {num_gpus} GPU(s)", param="reserve_mib")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
            raise RequestError(f"reserve {v!r} must be a finite number of MiB >= 0", param="reserve_mib")
    return list(values) + [None] * (num_gpus - len(values))


def format_line(values: dict[str, list]) -> str:
    def fmt(v):
        return str(int(v)) if float(v).is_integer() else f"{v:.1f}"
    return " ".join(f"{k}=" + ",".join(fmt(v) for v in values[k]) for k in FIELDS)


@dataclass
class VramFanout:
    """One client VRAM request in flight: one reply expected per worker."""

    client: bytes
    reserves: list[float | None]
    query: bool
    request_id: str | None = None
    replies: dict[int, VramReply] = field(default_factory=dict)
    on_done: Callable[[VramReply], None] | None = None  # the broker's own fan-out (vision): no client reply
    fanout_id: str | None = None  # the id the workers echo (a client's id may repeat)
    started_s: float = 0.0
    timed_out: bool = False
    interim: bool = False  # a step of the broker's own series (VramControl.internal): no INFO after it
    between_steps: bool = False  # the workers apply it between their own steps: steps go on meanwhile

    def complete(self, num_gpus: int) -> bool:
        return len(self.replies) == num_gpus

    def aggregate(self) -> VramReply:
        gpus = sorted(self.replies)
        errors = [f"gpu{g}: {self.replies[g].error}" for g in gpus if self.replies[g].error]
        values = {k: [getattr(self.replies[g], k) for g in gpus] for k in FIELDS}
        return VramReply(id=self.request_id, **values, line=format_line(values), error="; ".join(errors) or None)
