"""``moebus bench cache``: the text streams' trace (bench vision-cycle's prompts, greedy), a cache that
shrinks for an image part-way through, admissions landing a step launched ahead later, decays per policy."""
import subprocess
import sys

import numpy as np
import pytest

from moebus.bench import cache as bench_cache
from moebus.bench.vision_gaps import stream_prompt
from moebus.common.demo_model import demo_model_dir
from moebus.cuda.memory.arena import HostArena


def test_the_streams_trace_is_the_greedy_decode_of_the_streams_prompts():
    trace = bench_cache.streams_trace(str(demo_model_dir()), 12, 2)
    assert trace.shape == (12, 8, 2, 4) and trace.min() >= 0 and trace.max() < 64
    again = bench_cache.streams_trace(str(demo_model_dir()), 12, 2)
    assert np.array_equal(trace, again)  # greedy: the same routing every time
    assert stream_prompt(0) == [5, 17, 99] and stream_prompt(1) == [6, 17, 99]
    assert not np.array_equal(trace[:, :, 0], trace[:, :, 1])  # two streams, two texts


def test_a_shrink_part_way_gives_the_figures_after_it_apart():
    rng = np.random.default_rng(0)
    trace = rng.integers(0, 32, (60, 2, 2, 4)).astype(np.int32)
    whole = bench_cache.replay(trace, 32, None, "freq", slots=64)
    shrunk = bench_cache.replay(trace, 32, None, "freq", slots=64, shrink_at=30, shrink_to=20)
    assert whole["hit_rate"] == 1.0 and whole["h2d_experts_per_step"] == 0  # every expert fits
    assert shrunk["hit_rate"] == 1.0 and shrunk["after_hit_rate"] < 0.7  # 20 of 64 after the shrink
    assert shrunk["after_h2d_experts_per_step"] > 5 and shrunk["after_p90"] >= shrunk["after_h2d_experts_per_step"]


def test_landing_ahead_makes_an_admission_visible_two_steps_later():
    store = bench_cache.TraceStore(1, 8)
    arena = HostArena(store.blob_bytes, store.dtype, [store.blob_bytes] * 2)
    arena.grow()
    copier = bench_cache.LandingAhead(arena)
    from moebus.workers.expert_cache import ExpertCache
    from moebus.workers.eviction import FreqPolicy

    cache = ExpertCache(store, arena, copier=copier, policy=FreqPolicy(8, admission_margin=0.0))
    cache.observe(np.array([[[5]]]))  # step 0 misses expert 5 and admits it: copied after step 1
    assert cache.pending and cache.placement[0, 5] < 0  # the kernels still read it from the host store
    copier.step()
    assert not copier.is_done()  # step 1's observe: the copy runs beside step 2
    copier.step()
    cache.land_admissions()  # step 2's observe lands it; step 3 was launched before, step 4 reads it
    assert not cache.pending and cache.placement[0, 5] >= 0

    # expert 5 at every one of 8 steps, 2 slots held by others: with the margin it beats them at step 1's
    # observe; landing at once step 2 reads it (6 hits), landing ahead step 5 (3 hits), each copied once
    trace = np.stack([np.full((1, 1, 1), 5)] * 8)
    now = bench_cache.replay(trace, 8, None, "freq:0.9", slots=2, landing="now")
    ahead = bench_cache.replay(trace, 8, None, "freq:0.9", slots=2, landing="ahead")
    assert now == {"hit_rate": 6 / 8, "h2d_experts_per_step": 3 / 8}  # 2 misses read in place, 1 copy
    assert ahead == {"hit_rate": 3 / 8, "h2d_experts_per_step": 6 / 8}  # 5 misses, 1 copy


def test_the_routings_own_tail_is_the_largest_modelled_step_of_a_window_over_the_median():
    per_step = np.zeros((20, 3), np.int64)  # hits, misses, experts over PCIe
    per_step[:, 1] = 10
    per_step[:, 2] = 10  # 10 misses a step, no admissions: 1 + 0.5 * 10 = 6 ms
    per_step[12] = (0, 22, 24)  # 22 misses and 2 admissions: 1 + 11 + 2 = 14 ms
    model = (1.0, 0.5, 1.0)
    assert list(bench_cache.step_ms(per_step, model)[11:13]) == [6.0, 14.0]
    whole = bench_cache.tail_ratios(per_step, model, window=8, warmup=2, shrink_at=None)
    assert whole["step_ms_median"] == 6.0
    # windows of 8 from step 2, 2 apart: those holding step 12 (starting at 2+6, 2+8) see 14 / 6, the others 1
    assert whole["tail_max"] == 14 / 6 and whole["tail_min"] == 1.0
    shrunk = bench_cache.tail_ratios(per_step, model, window=8, warmup=2, shrink_at=13)
    assert shrunk == {"step_ms_median": 6.0, "tail_after_shrink": 1.0}  # the window from step 13 misses step 12
    assert bench_cache.tail_ratios(per_step, model, 8, 2, shrink_at=10)["tail_after_shrink"] == 14 / 6

    rng = np.random.default_rng(1)  # a smaller cache: more misses a step, their spread a smaller share
    trace = rng.integers(0, 32, (200, 2, 2, 4)).astype(np.int32)
    small, large = (bench_cache.replay(trace, 32, None, "freq", slots=n, landing="ahead", step_model=(1.0, 0.2, 0.2),
                                       window=64) for n in (8, 56))
    assert small["step_ms_median"] > large["step_ms_median"] and small["tail_max"] < large["tail_max"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "moebus.cli", "bench", "cache", *args], capture_output=True,
                          text=True, timeout=300)


def test_the_cli_replays_a_streams_trace_it_saved(tmp_path):
    saved = tmp_path / "streams.npy"
    args = ["--trace", "streams", "--batch", "2", "--steps", "30", "--trace-file", str(saved), "--slots", "200",
            "--shrink-at", "15", "--shrink-to", "120", "--landing", "ahead", "--policies", "freq:0.9,freq,lru"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert saved.exists() and np.load(saved).shape == (30, 8, 2, 4)
    assert "streams trace: 30 steps, 8 layers x 64 experts, batch 2" in first.stdout
    assert "then 120 slots from step 15" in first.stdout and "freq:0.9" in first.stdout
    again = run_cli(*args)  # read back, not recorded again: the same figures
    assert again.returncode == 0 and again.stdout == first.stdout
    tail = run_cli(*args, "--step-model", "1.39,0.165,0.22", "--window", "10")
    assert tail.returncode == 0, tail.stderr
    assert "    tail: freq:0.9 " in tail.stdout and "the largest of 10 steps over the median" in tail.stdout


@pytest.mark.parametrize("args, said", [
    (["--policies", "freq:2"], "not freq, freq:DECAY"),
    (["--policies", "lru:0.9"], "not freq, freq:DECAY"),
    (["--policies", "clock"], "not freq, freq:DECAY"),
    (["--shrink-at", "5"], "--shrink-at and --shrink-to go together"),
    (["--slots", "0"], "argument --slots: expected a whole number >= 1, got '0'"),
    (["--slots", "-5"], "argument --slots: expected a whole number >= 1, got '-5'"),
    (["--slots", "ten"], "argument --slots: expected a whole number >= 1, got 'ten'"),
    (["--steps", "0"], "argument --steps: expected a whole number >= 1, got '0'"),
    (["--slots", "10", "--shrink-at", "-1", "--shrink-to", "5"], "argument --shrink-at: expected a whole number >= 0"),
    (["--slots", "10", "--shrink-at", "5", "--shrink-to", "0"], "argument --shrink-to: expected a whole number >= 1"),
    (["--slots", "99999999999"], "--slots 99999999999: the trace has 12 layers x 128 experts"),
    (["--slots", "10", "--shrink-at", "10", "--shrink-to", "5"], "--shrink-at 10: the trace has 10 steps"),
    (["--step-model", "1,2"], "argument --step-model: expected three ms"),
    (["--step-model", "1,0,1"], "argument --step-model: expected three ms"),
    (["--step-model", "1,0.2,-1"], "argument --step-model: expected three ms"),
    (["--step-model", "a,b,c"], "argument --step-model: expected three ms"),
    (["--step-model", "1,nan,1"], "argument --step-model: expected three ms"),
    (["--window", "0"], "argument --window: expected a whole number >= 1, got '0'"),
])
def test_bad_options_are_refused_by_name(args, said):
    out = run_cli("--trace", "synthetic", "--steps", "10", *args)
    assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr


def test_a_file_that_is_no_trace_is_named_not_unpickled(tmp_path):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([{"a": 1}], dtype=object), allow_pickle=True)  # a pickle: never loaded
    out = run_cli("--trace", "streams", "--batch", "2", "--trace-file", str(bad))
    assert out.returncode == 1 and f"{bad}: not a trace this command wrote" in out.stderr
    assert "Traceback" not in out.stderr
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"\xff\xfe not numpy")
    out = run_cli("--trace", "streams", "--batch", "2", "--trace-file", str(garbage))
    assert out.returncode == 1 and f"{garbage}: not a trace this command wrote" in out.stderr


def brute_force_min(keys: list[set[int]], slots: int) -> int:
    """The fewest misses over every choice of what to keep after each step (tiny cases only)."""
    from functools import lru_cache
    from itertools import combinations

    universe = sorted(set().union(*keys))

    @lru_cache(maxsize=None)
    def best(step: int, resident: frozenset) -> int:
        if step == len(keys):
            return 0
        missed = len(keys[step] - resident)
        pool = sorted(resident | keys[step])  # after a step: any of what was resident or just read
        options = [frozenset(c) for n in range(min(slots, len(pool)) + 1) for c in combinations(pool, n)]
        return missed + min(best(step + 1, o) for o in options)

    return min(best(0, frozenset(c)) for n in range(slots + 1) for c in combinations(universe, n))


def test_the_min_bound_is_the_fewest_misses_and_below_every_policy():
    from moebus.bench.cache_bound import min_misses

    rng = np.random.default_rng(1)
    for case in range(6):
        trace = rng.integers(0, 6, (7, 1, 1, 2)).astype(np.int32)
        keys = [set(int(k) for k in step.reshape(-1)) for step in trace]
        bound = int(min_misses(trace, 6, 3)[:, 1].sum())
        assert bound == brute_force_min(keys, 3), case
    trace = rng.integers(0, 16, (80, 2, 2, 3)).astype(np.int32)
    bound = bench_cache.replay(trace, 16, None, "min", slots=12, shrink_at=40, shrink_to=8)
    for policy in ("freq", "freq:0.9", "lru", "lru-all"):
        got = bench_cache.replay(trace, 16, None, policy, slots=12, shrink_at=40, shrink_to=8)
        assert bound["hit_rate"] >= got["hit_rate"] and bound["after_hit_rate"] >= got["after_hit_rate"], policy
        assert bound["h2d_experts_per_step"] <= got["h2d_experts_per_step"], policy
