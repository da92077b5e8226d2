"""The decode steps of each phase of a cold image start (broker/vision_phases.py), from the broker's
step counters at each mark: how many, their mean time plan to tokens and inside the workers."""
from __future__ import annotations

import pytest

from moebus.broker.stats import Stats
from moebus.broker.vision_phases import PhaseSteps


def steps(stats: Stats, count: int, step_s: float, compute_s: float) -> None:
    for _ in range(count):
        stats.count("steps_total")
        stats.observe("step_seconds", step_s)
        stats.observe("step_compute_seconds", compute_s)


def test_each_phase_counts_the_steps_between_its_marks():
    stats = Stats()
    steps(stats, 5, 0.001, 0.001)  # before the cold start: not counted
    phases = PhaseSteps(stats)
    phases.mark("began")
    steps(stats, 4, 0.004, 0.003)
    phases.mark("handed_back")
    steps(stats, 2, 0.020, 0.018)
    phases.mark("ready")
    phases.mark("ready")  # a second mark of a name is ignored: the first time counts
    phases.mark("encode_sent")
    got = phases.by_phase()
    assert set(got) == {"handback", "start", "ready_to_encode"}  # encode and prefill not reached yet
    assert got["handback"] == pytest.approx({"steps": 4, "step_ms": 4.0, "compute_ms": 3.0})
    assert got["start"] == pytest.approx({"steps": 2, "step_ms": 20.0, "compute_ms": 18.0})
    assert got["ready_to_encode"] == {"steps": 0, "step_ms": None, "compute_ms": None}


def test_the_split_gives_the_prefill_once_the_first_token_came():
    from types import SimpleNamespace

    from moebus.broker.vision_phases import cold_start_split

    phases = PhaseSteps(Stats())
    seq = SimpleNamespace(first_token_s=None)
    cycle = {"began_s": 10.0, "queued_s": 0.001, "handback_s": 0.2, "handed_back_s": 10.2, "start_s": 0.8,
             "submitted_s": 11.1, "seq": seq, "handback_requests": 29}
    split = cold_start_split(cycle, phases)
    assert split == {"queued_s": 0.001, "handback_s": 0.2, "start_s": 0.8, "handback_requests": 29, "steps": {}}
    seq.first_token_s = 11.6
    assert cold_start_split(cycle, phases)["prefill_s"] == pytest.approx(0.5)


def test_each_mark_asks_the_workers_and_keeps_their_cache_counters():
    stats, asked = Stats(), []
    phases = PhaseSteps(stats, num_workers=2, ask_info=lambda: asked.append(1))
    slot = 9 << 20

    def info(hits, misses, copies):
        return {"hits": hits, "misses": misses, "h2d_bytes": (misses + copies) * slot, "expert_slot_bytes": slot}

    phases.mark("began")
    phases.on_worker_info(0, info(100, 10, 5))
    assert "began" not in phases.cache  # gpu1 has not answered since the mark
    phases.on_worker_info(1, info(50, 4, 0))
    steps(stats, 10, 0.011, 0.010)
    phases.mark("handed_back")
    phases.mark("handed_back")  # asked once per mark
    phases.on_worker_info(1, info(60, 34, 20))
    phases.on_worker_info(0, info(150, 40, 25))
    assert len(asked) == 2 and phases.cache["began"]["misses"] == 14 and phases.cache["handed_back"]["misses"] == 74
    got = phases.by_phase()["handback"]
    # 60 misses and 40 copies beyond them over 10 steps
    assert got == pytest.approx({"steps": 10, "step_ms": 11.0, "compute_ms": 10.0, "misses_per_step": 6.0,
                                 "h2d_mib_per_step": 90.0, "copies_per_step": 4.0})
    assert "misses_per_step" not in PhaseSteps(stats).by_phase().get("handback", {})  # no ask_info: no counters
