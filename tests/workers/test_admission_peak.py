"""A decode step's admissions within the link's room (workers/expert_cache.py, ``MOEBUS_ADMISSION_PEAK``):
when the text's working set moves on, a step misses far more than usual; it then admits at most
ADMISSION_FLOOR experts instead of up to its cap (the copies share the PCIe link with the misses read
in place), and the new working set still comes in over the next steps."""
import numpy as np
import pytest

from moebus.bench.cache import TraceStore
from moebus.common.errors import ConfigError
from moebus.cuda.memory.arena import HostArena
from moebus.workers.expert_cache import ADMISSION_FLOOR, ExpertCache, admission_peak_from_env
from moebus.workers.eviction import FreqPolicy

LAYERS, EXPERTS, BATCH, TOP_K = 2, 128, 2, 8
STEADY, SHIFTED = 60, 60


def working_set(rng, first: int, steps: int) -> np.ndarray:
    """Each step's choices (layers, batch, top-k) drawn from 24 experts a layer starting at ``first``."""
    pool = np.arange(first, first + 24)
    return np.array([[[rng.choice(pool, TOP_K, replace=False) for _ in range(BATCH)] for _ in range(LAYERS)]
                     for _ in range(steps)], np.int32)


def replay(trace: np.ndarray, peak: float) -> tuple[list[int], list[int]]:
    """Each step's misses and admissions (copies beyond the misses) on the decode path, a cache of 25% of
    the experts (64 slots: room for both working sets' hottest part, not for all of them)."""
    store = TraceStore(LAYERS, EXPERTS)
    slots = LAYERS * EXPERTS // 4
    arena = HostArena(store.blob_bytes, store.dtype, [slots * store.blob_bytes])
    arena.grow()
    cache = ExpertCache(store, arena, policy=FreqPolicy(LAYERS * EXPERTS, admission_margin=1.0), max_admissions=32)
    cache.admission_peak = peak
    misses, admitted = [], []
    for chosen in trace:
        before_misses, before_bytes = cache.misses, cache.h2d_bytes
        cache.observe(chosen)
        missed = cache.misses - before_misses
        misses.append(missed)
        admitted.append((cache.h2d_bytes - before_bytes) // store.blob_bytes - missed)
    return misses, admitted


def test_a_step_that_misses_far_more_than_usual_admits_at_most_the_floor_and_the_new_set_still_comes_in():
    rng = np.random.default_rng(25)
    trace = np.concatenate([working_set(rng, 0, STEADY), working_set(rng, 64, SHIFTED)])
    capped_misses, capped = replay(trace, peak=2.0)
    free_misses, uncapped = replay(trace, peak=0.0)
    assert capped_misses[:STEADY] == free_misses[:STEADY] and capped[:STEADY] == uncapped[:STEADY]  # no peak yet
    shift = slice(STEADY, STEADY + 3)
    assert max(uncapped[shift]) > 10, uncapped[shift]  # the uncapped cache copies up to its cap at once
    assert max(capped[shift]) <= ADMISSION_FLOOR, capped[shift]
    # the new working set comes in all the same: the last steps miss as few experts as the uncapped cache's
    tail = slice(-10, None)
    assert np.mean(capped_misses[tail]) <= np.mean(free_misses[tail]) + 1, (capped_misses[tail], free_misses[tail])
    assert np.mean(capped_misses[tail]) < 0.25 * max(capped_misses[shift]), capped_misses
    # and no step carries both the shift's misses and a full cap of copies: the shift's busiest step moves fewer
    busiest = [max(m + a for m, a in list(zip(misses, copies))[STEADY:])
               for misses, copies in ((capped_misses, capped), (free_misses, uncapped))]
    assert busiest[0] <= busiest[1] - 10, busiest


def test_the_setting_is_a_number_at_least_zero():
    assert admission_peak_from_env({}) == 2.0 and admission_peak_from_env({"MOEBUS_ADMISSION_PEAK": "0"}) == 0.0
    for text in ("two", "", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="MOEBUS_ADMISSION_PEAK must be a number >= 0"):
            admission_peak_from_env({"MOEBUS_ADMISSION_PEAK": text})
