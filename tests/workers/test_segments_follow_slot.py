"""segment_mib 0: the expert arena's segments follow the slot (two slots a segment, in whole 2 MiB
granules), so a VRAM request unmaps and releases one allocation per two experts instead of one per
2 MiB; the emulated GPU's ledger gives back the same whole segments, and the bench's check compares
within one segment's two slots."""
import pytest

from moebus.bench.vision_cycle import effective_segment_mib, slots_per_segment
from moebus.common.checkpoint import Checkpoint
from moebus.common.errors import ConfigError
from moebus.common.settings import load_settings
from moebus.cuda.backends.cpu import CpuBackend
from moebus.cuda.memory.ledger import MIB, EmulatedGpu
from moebus.cuda.memory.arena import segment_bytes_for
from moebus.workers.experts import build_expert_cache


def test_two_slots_a_segment_in_whole_granules():
    a3b = 3 * 2048 * 768 * 2  # a bf16 Qwen3-30B-A3B expert: 9 MiB
    assert segment_bytes_for(0, a3b) == 18 * MIB
    assert segment_bytes_for(0, 3 * 256 * 128 * 2) == 2 * MIB  # the demo's 192 KiB experts: as before
    assert segment_bytes_for(0, 5 * MIB + 1) == 12 * MIB
    assert segment_bytes_for(2 * MIB, a3b) == 2 * MIB and segment_bytes_for(64 * MIB, a3b) == 64 * MIB


def test_the_setting_takes_0_and_refuses_a_negative(monkeypatch):
    monkeypatch.setenv("MOEBUS_SEGMENT_MIB", "0")
    assert load_settings().segment_mib == 0
    monkeypatch.setenv("MOEBUS_SEGMENT_MIB", "-2")
    with pytest.raises(ConfigError, match="segment_mib"):
        load_settings()


def test_a_cuda_worker_refuses_an_odd_segment_size_before_it_loads_anything(monkeypatch):
    """cuMemCreate takes whole 2 MiB granules: 3 MiB would fail inside the arena with a driver-side
    ValueError after the dense weights loaded; the worker's start says which setting at once (the cpu
    arena's emulated segments take any whole MiB, which the cpu tests use)."""
    from moebus.workers.gpu_worker import load_stage

    monkeypatch.setenv("MOEBUS_SEGMENT_MIB", "3")
    with pytest.raises(ConfigError, match="segment_mib 3: on cuda .* even number of MiB, or 0"):
        load_stage(load_settings(), "/nonexistent", 0, range(2), "cuda")


def test_an_elastic_cache_of_slot_sized_segments_shrinks_and_regrows_whole_ones(tmp_path, demo_model):
    gpu = EmulatedGpu(tmp_path / "gpu0", capacity_mib=16)
    ckpt = Checkpoint(demo_model)
    cache = build_expert_cache(ckpt, range(2), CpuBackend(), capacity_bytes=8 * MIB, elastic=True, gpu=gpu,
                               segment_bytes=0, preload=False)
    # two 192 KiB slots: one granule (0 taken as is would have planned segments of no bytes: a division by zero)
    assert set(cache.arena.startup_segments) == {2 * MIB}
    full = cache.report()
    shrunk = cache.resize(full["free_mib"] + 4)
    assert shrunk["expert_cache_mib"] == 4 and gpu.memory_info()[0] >= (full["free_mib"] + 4) * MIB
    assert cache.resize(None) == full


def test_the_bench_compares_within_two_slots_where_segments_follow_the_slot(monkeypatch):
    row = {"slots": [753], "cache_mib": [6778.0]}  # 9 MiB slots: 18 MiB segments
    assert slots_per_segment(row, 0) == [2] and slots_per_segment(row, 18) == [2] and slots_per_segment(row, 2) == [1]
    demo = {"slots": [64, 0], "cache_mib": [12.0, 0.0]}  # 192 KiB slots: a 2 MiB granule holds 11 (rounded up)
    assert slots_per_segment(demo, 0) == [11, 1] == slots_per_segment(demo, 2)
    monkeypatch.delenv("MOEBUS_SEGMENT_MIB", raising=False)
    assert effective_segment_mib(None) == 0 == effective_segment_mib(0) and effective_segment_mib(18) == 18
    monkeypatch.setenv("MOEBUS_SEGMENT_MIB", "18")  # the environment wins over the bench's config file
    assert effective_segment_mib(None) == 18 == effective_segment_mib(2)
