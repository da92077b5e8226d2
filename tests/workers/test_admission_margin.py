"""The freq policy's admission margin (workers/eviction.py, ``MOEBUS_ADMISSION_MARGIN``): with
near-uniform routing (a randomly initialised model) every miss beats a resident unused for a few
steps, so margin 0 copies in up to the cap every step for no hits; a margin of 1 copies far fewer
with the same hit rate. The shrink's moves keep comparing without a margin."""
import numpy as np
import pytest

from moebus.bench.cache import TraceStore
from moebus.common.errors import ConfigError
from moebus.cuda.memory.arena import HostArena
from moebus.workers.expert_cache import ExpertCache
from moebus.workers.eviction import FreqPolicy, admission_margin_from_env

LAYERS, EXPERTS, BATCH, TOP_K, STEPS, WARM = 2, 128, 2, 8, 200, 20  # the A3B shape's layer, fewer layers


def replay(trace, fraction: float, margin: float) -> tuple[float, float]:
    """(hit rate, copies a step beyond the misses) of the decode path over ``trace``."""
    store = TraceStore(LAYERS, EXPERTS)
    slots = int(fraction * LAYERS * EXPERTS)
    arena = HostArena(store.blob_bytes, store.dtype, [slots * store.blob_bytes])
    arena.grow()
    cache = ExpertCache(store, arena, policy=FreqPolicy(LAYERS * EXPERTS, admission_margin=margin))
    cache.preload()
    for step, chosen in enumerate(trace):
        if step == WARM:
            cache.hits = cache.misses = cache.h2d_bytes = 0
        cache.observe(chosen)
    copies = cache.h2d_bytes / store.blob_bytes - cache.misses
    return cache.hits / (cache.hits + cache.misses), copies / (STEPS - WARM)


def test_a_margin_stops_the_churn_of_uniform_routing():
    rng = np.random.default_rng(0)
    trace = np.array([[[rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(BATCH)] for _ in range(LAYERS)]
                      for _ in range(STEPS)], np.int32)
    for fraction in (0.5, 0.64):
        hit0, copies0 = replay(trace, fraction, 0.0)
        hit1, copies1 = replay(trace, fraction, 1.0)
        assert copies0 > 1.0 and copies1 < 0.75 * copies0, (fraction, copies0, copies1)
        assert abs(hit1 - hit0) < 0.02 and abs(hit0 - fraction) < 0.05, (fraction, hit0, hit1)


def test_the_margin_applies_to_admissions_not_to_the_shrinks_moves():
    policy = FreqPolicy(4, decay=0.9, admission_margin=1.0)
    policy.observe(np.array([0, 1]))
    policy.observe(np.array([0]))  # scores: key 0 1.9, key 1 0.9
    assert policy.worth_keeping(0, 1) and not policy.worth_admitting(0, 1)
    policy.observe(np.array([0]))  # key 0 2.71, key 1 0.81
    assert policy.worth_admitting(0, 1) and not policy.worth_admitting(1, 0)
    assert admission_margin_from_env({}) == 1.0  # the default, measured on the H200 (eighth session)


def test_a_margin_that_is_not_a_number_is_a_clear_settings_error():
    assert admission_margin_from_env({}) == 1.0 and admission_margin_from_env({"MOEBUS_ADMISSION_MARGIN": "1.5"}) == 1.5
    for text in ("one", "", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="MOEBUS_ADMISSION_MARGIN must be a number >= 0"):
            admission_margin_from_env({"MOEBUS_ADMISSION_MARGIN": text})


def test_the_setting_is_read_where_a_policy_is_made_not_at_import(monkeypatch):
    monkeypatch.setenv("MOEBUS_ADMISSION_MARGIN", "two")
    with pytest.raises(ConfigError, match="'two'"):
        FreqPolicy(4)
    monkeypatch.setenv("MOEBUS_ADMISSION_MARGIN", "2")
    assert FreqPolicy(4).admission_margin == 2.0
