"""The JSON behind the dashboard (``GET /v1/cache``): the broker's INFO reshaped for a page. Per GPU
the cache's size, free VRAM, reserve, counters and residency map; the request queue; the history
the broker keeps (tok/s, hit rate, VRAM events); the vision worker's state when INFO carries one."""
from __future__ import annotations

GPU_KEYS = ("gpu", "ready", "layers", "expert_slots", "expert_cache_mib", "free_mib", "reserve_mib",
            "resident_experts", "hits", "misses", "h2d_bytes", "restarts", "experts_dtype", "expert_slot_bytes",
            "attention_dtype", "lm_head_dtype")


def hit_rate(hits, misses) -> float | None:
    if not isinstance(hits, int) or not isinstance(misses, int) or hits + misses == 0:
        return None
    return hits / (hits + misses)


def gpu_view(gpu: dict) -> dict:
    """One GPU worker as the page shows it; a key INFO lacks (a worker still loading) stays None."""
    view = {key: gpu.get(key) for key in GPU_KEYS}
    view["hit_rate"] = hit_rate(gpu.get("hits"), gpu.get("misses"))
    view["residency"] = gpu.get("residency")
    return view


def cache_view(info: dict) -> dict:
    history = info.get("history") or {}
    return {
        "model": info.get("model"),
        "ready": bool(info.get("ready")),
        "now_s": history.get("now_s"),
        "requests": {"running": info.get("requests_running", 0), "waiting": info.get("requests_waiting", 0)},
        "gpus": [gpu_view(g) for g in info.get("gpus") or []],
        "rates": {key: history.get(key, []) for key in ("t_s", "dt_s", "tokens", "tok_s", "hits", "lookups",
                                                        "hit_rate")},
        "window_s": history.get("window_s"),
        "vram_events": history.get("vram_events", []),
        "vision": info.get("vision"),  # None: this service has no vision worker
    }
