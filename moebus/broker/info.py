"""The broker's INFO reply: its state, metrics and history, and each stage's figures as the stage
last reported them. The api renders /metrics, /health and the dashboard from it (plain data, so
it crosses the wire as msgpack)."""
from __future__ import annotations


def info_stats(broker) -> dict:
    """INFO_REPLY's ``stats`` for ``broker`` (a moebus.broker.broker.Broker)."""
    b, vision = broker, broker.vision
    return {"ready": b.pool.all_ready(), "model": b.model_name,
            "requests_running": len(b.scheduler.running), "requests_waiting": len(b.scheduler.waiting),
            "max_context": b.settings.max_context, "vocab_size": b.config.vocab_size,
            "requests_tokenizing": len(b.tokenize.pending), "vram_reserves_mib": list(b.vram.reserves),
            **b.stats.to_dict(), **(vision.info() if vision else {"vision_loaded": 0}),
            "history": b.history.to_dict(),
            "gpus": [{"gpu": w.gpu, "ready": w.is_ready, "layers": [w.layers.start, w.layers.stop],
                      "restarts": w.child.restarts if w.child else 0, **w.info, **w.vram} for w in b.pool]}
