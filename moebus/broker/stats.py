"""Metrics state, owned by the broker and rendered by the api: counters, gauges and histograms with
fixed buckets (plain data, so it crosses the wire as msgpack)."""
from __future__ import annotations

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS_S):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


class Stats:
    def __init__(self):
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_total": 0,
                         "requests_finished_total": 0, "requests_failed_total": 0, "requests_cancelled_total": 0,
                         "invalid_messages_total": 0, "worker_restarts_total": 0, "steps_total": 0, "pipelined_steps_total": 0,
                         "lookahead_steps_total": 0, "held_chunk_lookahead_steps_total": 0,
                         "vision_starts_total": 0, "images_total": 0, "images_reused_total": 0, "internal_errors_total": 0,
                         "undeliverable_replies_total": 0}
        self.histograms = {"time_to_first_token_seconds": Histogram(), "inter_token_latency_seconds": Histogram(),
                           "e2e_request_latency_seconds": Histogram(), "step_seconds": Histogram(),
                           "step_compute_seconds": Histogram(), "vision_start_seconds": Histogram(),
                           "vision_encode_seconds": Histogram()}

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def to_dict(self) -> dict:
        return {"counters": dict(self.counters), "histograms": {k: h.to_dict() for k, h in self.histograms.items()}}
