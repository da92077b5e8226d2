"""The broker's history for the dashboard: rates per sampling interval and VRAM events told apart
by what the caches did (hand-back, regrow)."""
from moebus.broker.history import History
from moebus.common.protocol import VramReply


def _gpus(hits, misses, mib):
    return [{"hits": h, "misses": m, "expert_cache_mib": c} for h, m, c in zip(hits, misses, mib)]


def test_rates_per_interval_and_a_window_that_forgets():
    h = History(window_s=10)
    h.sample(0, _gpus([0, 0], [0, 0], [40, 40]), now_s=100.0)
    h.sample(20, _gpus([6, 2], [1, 1], [40, 40]), now_s=102.0)   # 8 hits of 10 lookups, 10 tok/s
    h.sample(20, _gpus([6, 2], [1, 1], [40, 40]), now_s=104.0)   # idle: no lookups
    h.sample(30, _gpus([1, 0], [0, 0], [40, 40]), now_s=106.0)   # counters went back: a worker restarted
    r = h.rates()
    assert r["t_s"] == [102.0, 104.0, 106.0]
    assert r["tok_s"] == [10.0, 0.0, 5.0] and r["hit_rate"] == [0.8, None, None]
    h.sample(99, _gpus([9, 9], [0, 0], [40, 40]), now_s=106.5)  # too soon after the last one: no point
    h.sample(30, _gpus([1, 0], [0, 0], [40, 40]), now_s=113.0)
    assert h.rates()["t_s"] == [106.0, 113.0]  # samples older than the window are gone


def test_vram_events_name_hand_back_and_regrow():
    h = History()
    h.vram_reply([None, None], VramReply(reserve_mib=[0, 0], free_mib=[2, 2], expert_slots=[8, 8],
                                         expert_cache_mib=[40, 40]), query=True, now_s=0.5)
    assert h.to_dict()["vram_events"] == [] and h.cache_mib == [40, 40]
    h.cache_mib = None  # as before any INFO or query
    h.vram_reply([10, None], VramReply(reserve_mib=[10, 0], free_mib=[12, 2], expert_slots=[8, 8],
                                       expert_cache_mib=[40, 40]), now_s=1.0)
    h.sample(0, _gpus([0, 0], [0, 0], [40, 40]), now_s=2.0)
    shrink = VramReply(reserve_mib=[30, 30], free_mib=[32, 30], expert_slots=[4, 5], expert_cache_mib=[20, 26])
    h.vram_reply([30, 30], shrink, now_s=3.0)
    h.vram_reply([None, None], VramReply(reserve_mib=[0, 0], free_mib=[2, 2], expert_slots=[8, 8],
                                         expert_cache_mib=[40, 40]), now_s=4.0)
    kinds = [(e["kind"], e["delta_mib"]) for e in h.to_dict()["vram_events"]]
    assert kinds == [("resize", None), ("hand-back", -34.0), ("regrow", 34.0)]
    assert h.to_dict()["vram_events"][1]["expert_slots"] == [4, 5]
