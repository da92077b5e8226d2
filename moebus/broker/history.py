"""What the dashboard plots over the last minutes, kept by the broker (the api is stateless): tok/s
and the expert-cache hit rate per sampling interval, and the VRAM hand-back / regrow events. Times
are wall-clock seconds (``time.time()``), so a page can print them as clock times."""
from __future__ import annotations

import time
from collections import deque

WINDOW_S = 600.0  # how far back the rates go
MIN_INTERVAL_S = 1.5  # an INFO round asked early (after a resize) adds no point: short intervals are noise
MAX_EVENTS = 64


def _summed(gpus: list[dict], key: str) -> int:
    return sum(int(g.get(key) or 0) for g in gpus)


def _kind(delta_mib: float | None) -> str:
    if delta_mib is None:
        return "resize"  # no earlier size known to compare with
    return "regrow" if delta_mib > 0 else "hand-back" if delta_mib < 0 else "unchanged"


class History:
    def __init__(self, window_s: float = WINDOW_S, max_events: int = MAX_EVENTS):
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int, int]] = deque()  # (t_s, tokens, hits, misses)
        self.events: deque[dict] = deque(maxlen=max_events)
        self.cache_mib: list[float] | None = None  # last known size of each cache, to tell shrink from grow

    def sample(self, tokens_total: int, gpus: list[dict], now_s: float | None = None) -> None:
        """One point: the broker's generated-token counter and the workers' last INFO (hits, misses)."""
        now_s = time.time() if now_s is None else now_s
        sizes = [g.get("expert_cache_mib") for g in gpus]
        if all(isinstance(s, int | float) for s in sizes):
            self.cache_mib = [float(s) for s in sizes]
        if self.samples and now_s - self.samples[-1][0] < MIN_INTERVAL_S:
            return
        self.samples.append((now_s, tokens_total, _summed(gpus, "hits"), _summed(gpus, "misses")))
        while self.samples and self.samples[0][0] < now_s - self.window_s:
            self.samples.popleft()

    def vram_reply(self, reserves: list, reply, query: bool = False, now_s: float | None = None) -> None:
        """A VRAM request that every worker answered: ``reserves`` as requested (None: start-up
        size), ``reply`` the aggregated VramReply. A query is no event but tells the sizes."""
        after = [float(v) for v in reply.expert_cache_mib]
        if query:
            self.cache_mib = after
            return
        delta = sum(after) - sum(self.cache_mib) if self.cache_mib and len(self.cache_mib) == len(after) else None
        self.events.append({"t_s": time.time() if now_s is None else now_s, "kind": _kind(delta),
                            "reserve_mib": list(reserves), "expert_cache_mib": after,
                            "expert_slots": list(reply.expert_slots), "free_mib": list(reply.free_mib),
                            "delta_mib": delta, "error": reply.error})
        self.cache_mib = after

    def rates(self) -> dict:
        """Per interval between two samples: its end time and length, tokens, tok/s, expert hits,
        lookups and hits / lookups (None: no lookups, or a worker restarted and counts anew)."""
        out = {key: [] for key in ("t_s", "dt_s", "tokens", "tok_s", "hits", "lookups", "hit_rate")}
        pairs = list(self.samples)
        for (t0, tok0, h0, m0), (t1, tok1, h1, m1) in zip(pairs, pairs[1:]):
            if t1 <= t0:
                continue
            tokens, hits, misses = max(0, tok1 - tok0), h1 - h0, m1 - m0
            counted = hits >= 0 and misses >= 0  # negative: a worker restarted and counts from zero
            for key, value in (("t_s", t1), ("dt_s", t1 - t0), ("tokens", tokens), ("tok_s", tokens / (t1 - t0)),
                               ("hits", hits if counted else 0), ("lookups", hits + misses if counted else 0),
                               ("hit_rate", hits / (hits + misses) if counted and hits + misses > 0 else None)):
                out[key].append(value)
        return out

    def to_dict(self) -> dict:
        return {"now_s": time.time(), "window_s": self.window_s, **self.rates(), "vram_events": list(self.events)}
