"""/metrics: the broker's ``info()`` rendered for Prometheus. The broker owns every number; each scrape
renders them through a fresh registry with one custom collector, so the api keeps no state and all
WSGI workers answer alike. What ``info()`` lacks (e.g. cache counters before the elastic cache
exists) is left out rather than reported as zero."""
from __future__ import annotations

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from moebus.api.link import current_link

bp = Blueprint("metrics", __name__)
PREFIX = "moebus_"

HELP = {
    "requests_running": "Requests holding a sequence slot (prefilling or decoding).",
    "requests_waiting": "Requests queued for a sequence slot.",
    "ready": "1 when every GPU worker is ready.",
    "prompt_tokens_total": "Prompt tokens of requests that produced a first token.",
    "generation_tokens_total": "Tokens generated.",
    "requests_total": "Requests admitted.",
    "requests_finished_total": "Requests that ended with stop or length.",
    "requests_failed_total": "Requests that ended with an error.",
    "requests_cancelled_total": "Requests cancelled by their client.",
    "invalid_messages_total": "Undecodable or unexpected ZeroMQ messages.",
    "worker_restarts_total": "GPU worker restarts.",
    "steps_total": "Forward steps through all stages.",
    "pipelined_steps_total": "Steps started while another step was in flight (broker.pipeline).",
    "internal_errors_total": "Bugs caught by the broker loop (each failed only the requests it concerned).",
    "undeliverable_replies_total": "Replies a client could not take (gone or not reading); its requests were cancelled.",
    "time_to_first_token_seconds": "From arrival to the first generated token.",
    "inter_token_latency_seconds": "Between two tokens of one request.",
    "e2e_request_latency_seconds": "From arrival to the end of a request.",
    "step_seconds": "One forward step through all stages.",
    "vision_loaded": "1 while the vision worker is loaded (ready to encode).",
    "vision_starts_total": "Vision worker starts.",
    "images_total": "Images encoded.",
    "images_reused_total": "Images not encoded again: another choice of the same request encoded them.",
    "vision_start_seconds": "From the VRAM hand-back to the vision worker's READY.",
    "vision_encode_seconds": "One request's images encoded (the ENCODE round trip).",
}
GPU_GAUGES = {"expert_slots": "Expert cache slots.", "expert_cache_mib": "Expert cache size in MiB.",
              "free_mib": "Free VRAM in MiB.", "reserve_mib": "VRAM reserve in MiB (left free for others).",
              "resident_experts": "Experts resident in the VRAM cache.",
              "expert_slot_bytes": "Bytes of one expert in the cache (follows the experts' dtype)."}
GPU_COUNTERS = {"hits": ("expert_cache_hits_total", "Expert lookups found in the cache."),
                "misses": ("expert_cache_misses_total", "Expert lookups copied in from host memory."),
                "h2d_bytes": ("expert_h2d_bytes_total", "Bytes copied host to device for experts."),
                "steps": ("gpu_steps_total", "Steps served by the worker."),
                "busy_s": ("gpu_busy_seconds_total", "Seconds the worker spent in steps."),
                "restarts": ("gpu_worker_restarts_total", "Restarts of the worker process.")}
TOTALS = ("expert_slots", "expert_cache_mib")


def _number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class InfoCollector:
    def __init__(self, info: dict):
        self.info = info

    def collect(self):
        info = self.info
        for name in ("requests_running", "requests_waiting"):
            yield GaugeMetricFamily(PREFIX + name, HELP[name], value=info.get(name, 0))
        yield GaugeMetricFamily(PREFIX + "ready", HELP["ready"], value=1 if info.get("ready") else 0)
        yield GaugeMetricFamily(PREFIX + "vision_loaded", HELP["vision_loaded"], value=info.get("vision_loaded", 0))
        for name, value in info.get("counters", {}).items():
            yield CounterMetricFamily(PREFIX + name, HELP.get(name, name), value=value)
        for name, h in info.get("histograms", {}).items():
            yield _histogram(PREFIX + name, HELP.get(name, name), h)
        yield from _gpu_families(info.get("gpus") or [])


def _histogram(name: str, doc: str, h: dict) -> HistogramMetricFamily:
    """The broker counts per bucket; Prometheus wants cumulative counts ending at +Inf."""
    bounds = [floatToGoString(b) for b in h["buckets"]] + ["+Inf"]
    cumulative, total = [], 0
    for bound, count in zip(bounds, h["counts"]):
        total += count
        cumulative.append((bound, total))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=h["sum"])


def _per_gpu(gpus: list[dict], key: str) -> list[tuple[str, float]]:
    values = [(str(g.get("gpu")), _number(g.get(key))) for g in gpus]
    return [(gpu, v) for gpu, v in values if v is not None]


def _labelled(family, values):
    for gpu, v in values:
        family.add_metric([gpu], v)
    return family


def _gpu_families(gpus: list[dict]):
    if gpus:
        yield _labelled(GaugeMetricFamily(PREFIX + "gpu_ready", "1 when the GPU worker is ready.", labels=["gpu"]),
                        [(str(g.get("gpu")), 1 if g.get("ready") else 0) for g in gpus])
    for key, doc in GPU_GAUGES.items():
        values = _per_gpu(gpus, key)
        if values:
            yield _labelled(GaugeMetricFamily(PREFIX + "gpu_" + key, doc, labels=["gpu"]), values)
        if values and key in TOTALS:
            yield GaugeMetricFamily(PREFIX + key, doc + " All GPUs.", value=sum(v for _, v in values))
    for key, held in (("experts_dtype", "experts"), ("attention_dtype", "attention projections"),
                      ("lm_head_dtype", "lm_head")):
        dtypes = [(str(g.get("gpu")), g[key]) for g in gpus if isinstance(g.get(key), str)]
        if dtypes:  # an info-style gauge: the dtype is a label
            family = GaugeMetricFamily(PREFIX + "gpu_" + key, f"1 for the dtype the GPU's {held} are held in.",
                                       labels=["gpu", "dtype"])
            for gpu, dtype in dtypes:
                family.add_metric([gpu, dtype], 1)
            yield family
    for key, (name, doc) in GPU_COUNTERS.items():
        values = _per_gpu(gpus, key)
        if values:
            yield _labelled(CounterMetricFamily(PREFIX + name, doc, labels=["gpu"]), values)


def render(info: dict) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(InfoCollector(info))
    return generate_latest(registry)


@bp.get("/metrics")
def metrics():
    return Response(render(current_link().info()), content_type=CONTENT_TYPE_LATEST)
