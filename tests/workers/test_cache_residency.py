"""ExpertCache.residency(): what the dashboard's layers x experts map is drawn from (resident keys
and their hits since admission; an evicted expert's hits are forgotten)."""
from tests.workers.test_expert_cache import make_cache


def test_residency_lists_resident_keys_with_hits_since_admission(tmp_path):
    cache, _ = make_cache(tmp_path, segments=1)  # 4 slots, LRU
    cache.acquire(0, [0, 1, 2, 3])
    cache.acquire(0, [0, 2])
    cache.acquire(0, [0])
    assert cache.residency()["keys"] == [0, 1, 2, 3]
    assert cache.residency()["hits"] == [2, 0, 1, 0]
    cache.acquire(1, [4])  # evicts the least recent, (0, 1)
    res = cache.residency()
    assert res["keys"] == [0, 2, 3, 10] and res["hits"] == [2, 1, 0, 0] and res["num_experts"] == 6
    cache.acquire(0, [1])  # back in after its eviction: counted from zero again
    res = cache.residency()
    assert dict(zip(res["keys"], res["hits"]))[1] == 0

def test_residency_empties_with_the_slots_a_shrink_hands_back(tmp_path):
    cache, _ = make_cache(tmp_path)  # 16 slots over 4 segments, 4 MiB free of 12
    cache.acquire(0, list(range(6)))
    cache.acquire(1, list(range(6)))
    cache.release()
    assert len(cache.residency()["keys"]) == 12
    report = cache.resize(10.0)  # 6 MiB missing: three segments go, 4 slots stay
    assert report["expert_slots"] == 4
    res = cache.residency()
    assert len(res["keys"]) == len(res["hits"]) == len(cache.key_slot) <= 4
