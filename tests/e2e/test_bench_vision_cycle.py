"""`moebus bench vision-cycle` on the cpu device (tiny LLaVA, tight emulated GPUs): it prints the four
rows with slots, cache MiB and free MiB from the workers, and its own check compares (a) and (c)
within one segment's slots (the hand-back releases whole segments)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from moebus.bench.vision_cycle import cycle_ok, grown_slots, slots_per_segment
from tests.e2e.vision_helpers import VISION_SERVE


def test_the_check_allows_one_segment_between_a_and_c():
    row = {"slots": [417, 120], "cache_mib": [3753.0, 1080.0]}  # 9 MiB slots: a 2 MiB segment holds < 1
    assert slots_per_segment(row, 2) == [1, 1]
    assert slots_per_segment({"slots": [64], "cache_mib": [12.0]}, 2) == [11]  # 5.3 slots a MiB
    assert cycle_ok([417], [589], [418], [589], [1])  # the H200 run that printed False
    assert not cycle_ok([417], [589], [420], [589], [1])
    assert not cycle_ok([417], [589], [417], [588], [1])  # (d) must regrow to (b) exactly
    assert not cycle_ok([589], [589], [589], [589], [1])  # nothing handed back: every expert fits


def test_below_a_the_check_allows_what_the_worker_took_beside_its_cache():
    """The H200 run at c7ade26: (c) 2 slots below (a) after the text streams' first steps took 16 MiB
    beside the cache (the hand-back frees until the vision worker's MiB are free, so that came out of
    the cache); the check allows exactly those slots below (a), and still one segment above."""
    idle = {"slots": [657], "cache_mib": [5920.0], "free_mib": [278.0]}
    before = {"slots": [657], "cache_mib": [5920.0], "free_mib": [262.0]}
    grown = grown_slots(idle, before)
    assert grown == [2]  # 16 MiB of 9.01 MiB slots, rounded up
    assert cycle_ok([488], [657], [486], [657], [1], grown)
    assert not cycle_ok([488], [657], [486], [657], [1])  # without it: 2 below, one segment allows 1
    assert not cycle_ok([488], [657], [484], [657], [1], grown)
    assert not cycle_ok([488], [657], [490], [657], [1], grown)  # above (a): one segment only
    moved = dict(before, cache_mib=[5911.0])  # a cache that changed meanwhile: no claim
    assert grown_slots(idle, moved) == [0]


def test_the_bench_prints_the_four_rows_on_cpu(tmp_path, tiny_llava):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    vram = [str(v) for v in VISION_SERVE["emulated_vram_mib"]]
    done = subprocess.run([sys.executable, "-m", "moebus.cli", "bench", "vision-cycle", "--model", str(tiny_llava),
                           "--device", "cpu", "--idle-s", "1", "--repeats", "1", "--text-streams", "2",
                           "--text-tokens", "16", "--max-context", "256", "--segment-mib",
                           str(VISION_SERVE["segment_mib"]), "--emulated-vram-mib", *vram, "--timeout-s", "120"],
                          capture_output=True, text=True, env=env, timeout=600)
    out = done.stdout
    rows = [line for line in out.splitlines() if line.startswith("(")]
    assert [r.split("  ")[0] for r in rows[:4]] == ["(a) vision resident (lazy false)", "(b) lazy, vision idle",
                                                     "(c) during an image request", "(d) idle_s after it"], out
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["idle"]) >= {"slots", "cache_mib", "free_mib", "device_free_mib"}
    assert result["idle"]["device_free_mib"] == [None, None]  # the driver's figure is cuda's only
    check = next(line for line in out.splitlines() if line.startswith("(b) == (d) > (a) ≈ (c)"))
    assert check.endswith("True") and done.returncode == 0, out + done.stderr[-3000:]


def test_each_gap_is_charged_to_the_phase_it_ended_in():
    from moebus.bench.vision_cycle import _TextStreams, phase_max_gaps_s

    streams = object.__new__(_TextStreams)  # its timestamps only, no client
    streams.times = [[0.0, 0.01, 0.02, 0.15, 0.16, 0.50, 0.51], [0.005, 0.015, 0.30, 0.31]]
    split = {"queued_s": 0.0, "handback_s": 0.1, "start_s": 0.1, "ready_to_encode_s": 0.0, "encode_s": 0.1,
             "prefill_s": 0.3}
    gaps = phase_max_gaps_s(streams, 0.0, split)
    assert gaps["queued"] is None and gaps["ready_to_encode"] is None
    assert abs(gaps["handback"] - 0.01) < 1e-9  # 0.0->0.01, 0.01->0.02, 0.005->0.015
    assert abs(gaps["start"] - 0.13) < 1e-9  # 0.02->0.15 ended at 0.15
    assert abs(gaps["encode"] - 0.285) < 1e-9  # 0.015->0.30 ended at 0.30
    assert abs(gaps["prefill"] - 0.34) < 1e-9  # 0.16->0.50
    assert [round(g, 3) for g, _ in streams.largest_s(0.0, 2)] == [0.34, 0.285]
