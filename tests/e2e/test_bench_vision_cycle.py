"""`moebus bench vision-cycle` on the cpu device (tiny LLaVA, tight emulated GPUs): it prints the four
rows with slots, cache MiB and free MiB from the workers, and its own check compares (a) and (c)
within one segment's slots (the hand-back releases whole segments)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from moebus.bench.vision_cycle import VisionStartWatch, cycle_ok, grown_slots, row_of_info, slots_per_segment
from tests.e2e.vision_helpers import VISION_SERVE, served_vision


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


def test_row_c_comes_from_the_brokers_info_at_the_hand_backs_end():
    """Thirty-sixth session: at a 4096 MiB budget the image's prefill (1.4 s) outlasted --idle-s 1, the vision
    worker stopped and the caches began to regrow before the answer, and (c), read after it, showed 260 slots
    against (a)'s 254: the check printed False. The watch reads (c) from the broker's INFO (each worker's last
    VRAM reply: no worker is asked while the text's gaps are measured) as soon as the hand-back is done."""
    gpus = [{"gpu": 0, "expert_slots": 254, "expert_cache_mib": 2286.0, "free_mib": 634.0, "reserve_mib": 634.0,
             "device_free_mib": 76426.6}, {"gpu": 1, "expert_slots": 120, "expert_cache_mib": 1080.0,
                                           "free_mib": 0.0, "reserve_mib": 0.0}]
    assert row_of_info({"gpus": gpus}) == {"slots": [254, 120], "cache_mib": [2286.0, 1080.0],
                                           "free_mib": [634.0, 0.0], "device_free_mib": [76426.6, None]}
    assert row_of_info({"gpus": [{"gpu": 0, "ready": True}]}) is None  # no VRAM reply yet
    assert row_of_info({}) is None

    class Broker:  # the broker's INFO through a cold start: cold, handing back, the worker starting, regrowing
        def __init__(self):
            before = [dict(gpus[0], expert_slots=298), gpus[1]]
            self.replies = [{"vision": {"state": state}, "gpus": before} for state in ("cold", "handing_back")]
            self.replies += [{"vision": {"state": "starting"}, "gpus": gpus}, {"vision": {"state": "regrowing"},
                                                                                 "gpus": before}]
            self.asked = 0

        def info(self):
            self.asked += 1
            return self.replies[min(self.asked, len(self.replies)) - 1]

    broker = Broker()
    with VisionStartWatch(broker) as watch:
        deadline = time.monotonic() + 5
        while watch.row is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert watch.row["slots"] == [254, 120] and broker.asked == 3  # read once, at the hand-back's end
    idle = Broker()
    idle.replies = idle.replies[:1]  # a request that answered before the hand-back ended: no row
    with VisionStartWatch(idle) as watch:
        time.sleep(0.1)
    assert watch.row is None and idle.asked >= 2


def test_the_watch_reads_the_caches_as_the_hand_back_left_them(tmp_path, tiny_llava):
    """Against a real broker: the watch's row, read from the broker's INFO while the cold image runs, is the
    workers' own answer to a VRAM query after it (the vision worker still loaded: idle_s 30 s): gpu0 handed
    segments back, gpu1 kept its cache."""
    from moebus.bench.vision_cycle import _chat, _image_png

    with served_vision(tmp_path, tiny_llava, idle_s=30.0) as (_svc, client):
        before = client.vram(query=True)["expert_slots"]
        with VisionStartWatch(client) as watch:
            _chat(client, _image_png(64, seed=0))
        assert client.info()["vision"]["state"] == "ready"
        after = client.vram(query=True)
    assert watch.row is not None and watch.row["slots"] == after["expert_slots"]
    assert watch.row["cache_mib"] == after["expert_cache_mib"]
    assert watch.row["slots"][0] < before[0] and watch.row["slots"][1] == before[1]


def test_the_bench_prints_the_four_rows_on_cpu(tmp_path, tiny_llava):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    vram = [str(v) for v in VISION_SERVE["emulated_vram_mib"]]
    done = subprocess.run([sys.executable, "-m", "moebus.cli", "bench", "vision-cycle", "--model", str(tiny_llava),
                           "--device", "cpu", "--idle-s", "1", "--repeats", "1", "--text-streams", "2",
                           "--cold-starts", "2", "--max-context", "256", "--control-tokens", "24", "--segment-mib",
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
    gaps = result["text_gaps"]  # the text streams through the cold start, each stream's own gaps, by phase
    assert len(gaps["per_stream"]) == 2 and gaps["steady"]["n"] > 0 and gaps["steady"]["broker_steps"]["steps"] > 0
    assert gaps["by_phase"]["handback"]["length_ms"] > 0 and "phase" in out and "stream 1: median before" in out
    # the image-free window before the steady state: 24 tokens a stream (~24 gaps each, as the 2 ms polls catch
    # its ends), read against the same medians
    assert all(16 <= s["control_gaps"] <= 30 and s["ratio_control_cycle"] > 0 for s in gaps["per_stream"]), gaps
    assert gaps["control"]["n"] == sum(s["control_gaps"] for s in gaps["per_stream"])
    assert "gaps a stream without an image, before it / their median over the cycle (worst stream)" in out
    assert "/ their largest without an image (worst stream)" in out
    assert set(result["split"]["steps"]) >= {"handback", "start", "encode", "prefill"}
    start = result["split"]["steps"]["start"]  # each mark asked the workers for their caches' counters
    assert start["steps"] == 0 or start["misses_per_step"] >= 0 and start["h2d_mib_per_step"] >= 0, start
    assert len(result["earlier_splits"]) == 1 and "cold image request 1 of 2:" in out  # measured: the second
    # the "warm" encode says when the worker had stopped before it (idle_s 1 here: it may have)
    assert result["warm_encode_cold"] in (0, 1) and ("found the vision worker stopped" in out) == bool(
        result["warm_encode_cold"]), out


def test_each_gap_is_charged_to_the_phase_that_holds_its_middle():
    from moebus.bench.vision_gaps import gaps_by_phase, largest_ms

    times = [[0.0, 0.01, 0.02, 0.15, 0.16, 0.50, 0.51], [0.005, 0.015, 0.30, 0.31]]
    split = {"queued_s": 0.0, "handback_s": 0.1, "start_s": 0.1, "ready_to_encode_s": 0.0, "encode_s": 0.1,
             "prefill_s": 0.2}
    phases = gaps_by_phase(times, 0.0, split, ended=0.7)
    assert list(phases) == ["queued", "handback", "start", "ready_to_encode", "encode", "prefill", "decode"]
    assert phases["queued"]["n"] == 0 and phases["queued"]["max_ms"] is None
    assert phases["handback"]["n"] == 4 and abs(phases["handback"]["max_ms"] - 130) < 1e-6  # 0.02->0.15
    assert phases["start"]["n"] == 2 and abs(phases["start"]["max_ms"] - 285) < 1e-6  # 0.015->0.30: middle 0.1575
    assert phases["encode"]["n"] == 0
    assert phases["prefill"]["n"] == 2 and abs(phases["prefill"]["max_ms"] - 340) < 1e-6  # 0.16->0.50, 0.30->0.31
    assert phases["decode"]["n"] == 1 and abs(phases["decode"]["length_ms"] - 200) < 1e-6  # 0.50->0.51
    assert [round(g) for g, *_ in largest_ms(times, 0.0, 2)] == [340, 285]
    from moebus.bench.vision_gaps import phase_bounds  # each named by the phase that holds its middle, with its start
    named = largest_ms(times, 0.0, 2, phase_bounds(0.0, split, 0.7))
    assert [(round(t), round(a), phase) for _, t, a, phase in named] == [(500, 160, "prefill"), (300, 15, "start")]
    # the first token at the client (0.51) after the broker's mark (0.5): the prefill ends there
    late = gaps_by_phase(times, 0.0, dict(split, first_token_s=0.51), ended=0.7)
    assert late["prefill"]["n"] == 3 and late["decode"]["n"] == 0


def test_the_gaps_are_each_streams_own_and_the_ratio_is_the_worst_streams():
    """Two streams in one batch get their tokens from the same 10 ms step: pooled as one timeline their
    gaps would read ~0 and 10 ms; each stream's own gaps read 10 ms. A 25 ms gap of stream 1 in the
    hand-back is 2.5x its median; stream 0 kept 1.0x."""
    from moebus.bench.vision_gaps import gap_report, worst_ratio

    steps = [0.01 * i for i in range(20)]
    times = [list(steps), [t + 0.0001 for t in steps]]
    times[1] = [t if t < 0.12 else t + 0.015 for t in times[1]]  # one late token in stream 1 after the image went
    streams = SimpleNamespace(times=times, ran_until=lambda: min(ts[-1] for ts in times))
    split = {"queued_s": 0.0, "handback_s": 0.05, "start_s": 0.02, "ready_to_encode_s": 0.0, "encode_s": 0.01,
             "prefill_s": 0.02}
    report = gap_report(streams, (0.0, 0.1), 0.1, split, ended=0.19, steps={"steps": 10})
    assert report["steady"]["n"] == 20 and abs(report["steady"]["median_ms"] - 10) < 1e-6
    assert [round(s["ratio_until_encoded"], 2) for s in report["per_stream"]] == [1.0, 2.5]
    assert round(worst_ratio(report, "ratio_until_encoded"), 2) == 2.5 and report["covered"]
    # over the whole cycle (steady window to the end) stream 1's median is still 10 ms: one gap of 25, the rest 10
    assert [round(s["median_cycle_ms"], 3) for s in report["per_stream"]] == [10.0, 10.0]
    assert round(worst_ratio(report, "ratio_until_encoded_cycle"), 2) == 2.5
    assert abs(report["by_phase"]["handback"]["max_ms"] - 25) < 1e-6
    # the gaps through the cold start above 2x the median before: stream 1's 25 ms one alone
    assert [s["above_2x_cold"] for s in report["per_stream"]] == [0, 1]
    assert [s["cold_gaps"] for s in report["per_stream"]] == [9, 7]  # stream 1 late: two fewer gaps end by 0.19
    assert report["control"] is None and report["per_stream"][0]["ratio_control"] is None  # none asked for
    # an image-free window (here the steady one itself): its largest gap against the same medians
    alone = gap_report(streams, (0.0, 0.1), 0.1, split, ended=0.19, steps={"steps": 10}, control=(0.0, 0.1))
    assert alone["control"]["n"] == 20 and [s["control_gaps"] for s in alone["per_stream"]] == [10, 10]
    assert [round(s["ratio_control_cycle"], 2) for s in alone["per_stream"]] == [1.0, 1.0]
    # the image's own share: stream 1's 25 ms through the cold start against its 10 ms alone
    assert [round(s["ratio_until_encoded_control"], 2) for s in alone["per_stream"]] == [1.0, 2.5]


def test_the_broker_steps_of_the_steady_state():
    from moebus.bench.vision_gaps import steady_steps

    def info(steps, step_s, compute_s):
        return {"counters": {"steps_total": steps},
                "histograms": {"step_seconds": {"sum": step_s}, "step_compute_seconds": {"sum": compute_s}}}
    got = steady_steps(info(100, 1.0, 0.8), info(150, 1.2, 0.9), seconds=0.25)
    assert got == pytest.approx({"steps": 50, "interval_ms": 5.0, "step_ms": 4.0, "compute_ms": 2.0})
    assert steady_steps(info(1, 0, 0), info(1, 0, 0), 0.1)["step_ms"] is None


def test_text_streams_too_short_to_outlast_the_steady_state_are_refused(capsys):
    """--text-tokens at or below the warm-up + steady window would end the streams before the image
    goes, so its gaps would measure nothing: a clear argparse error (exit 2), before any broker."""
    from moebus.bench.vision_cycle import main
    from moebus.bench.vision_gaps import STEADY_TOKENS, WARM_TOKENS

    with pytest.raises(SystemExit) as ended:
        main(["--text-tokens", str(WARM_TOKENS + STEADY_TOKENS), "--device", "cpu"])
    assert ended.value.code == 2 and "--text-tokens" in capsys.readouterr().err


def test_settings_the_brokers_would_refuse_are_refused_before_any_broker(capsys):
    """--handback-step-mib 0 was once dropped as falsy (the default hand-back ran instead): it now
    reaches the settings, which refuse it with the key's name (exit 2); so does --max-batch 0."""
    from moebus.bench.vision_cycle import _settings, main

    for flag in (["--handback-step-mib", "0"], ["--max-batch", "0"]):
        with pytest.raises(SystemExit) as ended:
            main(flag + ["--device", "cpu", "--text-streams", "0"])
        err = capsys.readouterr().err
        assert ended.value.code == 2 and ("vision.handback_step_mib" in err or "max_batch" in err), err
    args = SimpleNamespace(idle_s=1.0, emulated_vram_mib=None, segment_mib=None, max_context=None,
                           gpu_memory_mib=None, handback_step_mib=64.0, max_batch=3, mps=False)
    assert _settings(args, lazy=True) == {"vision": {"lazy": True, "idle_s": 1.0, "handback_step_mib": 64.0},
                                          "max_batch": 3}
    assert _settings(SimpleNamespace(**{**vars(args), "mps": True}), lazy=True)["mps"] is True  # --mps
