"""The freq policy's decay a step (workers/eviction.py, ``MOEBUS_CACHE_DECAY``, default 0.98): a memory of
~50 steps keeps an expert set that a looping text reuses every ~20 steps against experts used twice in a
row and then not for long, where 0.9 (~10 steps) let each such pair evict one of the set, to miss it again
at the set's next turn."""
import numpy as np
import pytest

from moebus.bench.cache import replay
from moebus.common.errors import ConfigError
from moebus.workers.eviction import FreqPolicy, cache_decay_from_env

STEPS = 400


def looping_trace() -> np.ndarray:
    """One layer of 256 experts, two rows of 4 picks: row 0 loops over 80 experts (each every 20 steps),
    row 1 takes 4 experts for 2 steps in a row, each again only 88 steps later."""
    trace = np.zeros((STEPS, 1, 2, 4), np.int32)
    for step in range(STEPS):
        trace[step, 0, 0] = np.arange(4) + 4 * (step % 20)
        trace[step, 0, 1] = 80 + np.arange(4) + 4 * (step // 2 % 44)
    return trace


@pytest.mark.parametrize("landing", ["now", "ahead"])
def test_a_longer_memory_keeps_the_set_a_loop_reuses(landing):
    trace = looping_trace()
    short = replay(trace, 256, None, "freq:0.9", slots=84, landing=landing)
    long = replay(trace, 256, None, "freq:0.98", slots=84, landing=landing)
    # the loop's 80 experts fit in 84 slots: kept, row 0 always hits (half the lookups)
    assert long["hit_rate"] > 0.42 and short["hit_rate"] < 0.25, (short, long)
    assert long["h2d_experts_per_step"] < 0.65 * short["h2d_experts_per_step"], (short, long)


def test_the_default_decay_is_the_settings():
    assert cache_decay_from_env({}) == 0.98
    assert cache_decay_from_env({"MOEBUS_CACHE_DECAY": "0.9"}) == 0.9
    assert cache_decay_from_env({"MOEBUS_CACHE_DECAY": "1"}) == 1.0  # plain counts: nothing fades
    for text in ("0", "-0.5", "1.01", "nan", "inf", "", "high", "0,98"):
        with pytest.raises(ConfigError, match=r"MOEBUS_CACHE_DECAY must be a number in \(0, 1\]"):
            cache_decay_from_env({"MOEBUS_CACHE_DECAY": text})


def test_the_setting_is_read_where_a_policy_is_made_not_at_import(monkeypatch):
    monkeypatch.setenv("MOEBUS_CACHE_DECAY", "fast")
    with pytest.raises(ConfigError, match="'fast'"):
        FreqPolicy(4)
    monkeypatch.setenv("MOEBUS_CACHE_DECAY", "0.5")
    policy = FreqPolicy(4)
    policy.observe(np.array([1]))
    policy.observe(np.array([2]))
    assert policy.decay == 0.5 and policy.score.tolist() == [0.0, 0.5, 1.0, 0.0]
    assert FreqPolicy(4, decay=0.9).decay == 0.9  # an explicit decay wins
