"""A VRAM budget per GPU (workers/cache_sizing.py DeviceBudget): a GPU seen as if it had only the
budget. Driven here by a real emulated GPU's ledger standing in for the driver's cuMemGetInfo: what
this process and others allocate after the baseline counts against the budget, the rest of the GPU
stays outside it."""
from __future__ import annotations

import pytest

from moebus.common.settings import load_settings
from moebus.cuda.memory.ledger import MIB, EmulatedGpu, OutOfMemory
from moebus.workers.cache_sizing import DeviceBudget, budget_bytes


def test_budget_from_mib_and_utilization():
    total = 1000 * MIB
    assert budget_bytes(load_settings(), 0, total) is None
    assert budget_bytes(load_settings(gpu_memory_mib=[300, 500]), 1, total) == 500 * MIB
    assert budget_bytes(load_settings(gpu_memory_mib=[300]), 1, total) is None  # not given for gpu1
    assert budget_bytes(load_settings(gpu_memory_utilization=0.4), 0, total) == 400 * MIB
    assert budget_bytes(load_settings(gpu_memory_mib=[300], gpu_memory_utilization=0.4), 0, total) == 300 * MIB


def test_free_counts_within_the_budget(tmp_path):
    gpu = EmulatedGpu(tmp_path / "gpu0", capacity_mib=1000)
    gpu.allocate(100 * MIB, "another program, before moebus")
    budget = DeviceBudget(400 * MIB, gpu.memory_info)
    assert budget.memory_info() == (400 * MIB, 400 * MIB)
    gpu.allocate(150 * MIB, "dense weights and KV")
    assert budget.memory_info() == (250 * MIB, 400 * MIB) and budget.used_bytes() == 150 * MIB
    gpu.allocate(50 * MIB, "the vision worker")  # moebus' too: it counts against the same budget
    assert budget.memory_info() == (200 * MIB, 400 * MIB)


def test_the_driver_free_wins_when_other_programs_take_the_rest(tmp_path):
    gpu = EmulatedGpu(tmp_path / "gpu0", capacity_mib=500)
    budget = DeviceBudget(400 * MIB, gpu.memory_info)
    gpu.allocate(50 * MIB, "ours")
    assert budget.memory_info()[0] == 350 * MIB
    gpu.allocate(400 * MIB, "grows past the budget")  # the GPU has it; the budget does not
    assert budget.memory_info()[0] == 0
    with pytest.raises(OutOfMemory):
        gpu.allocate(60 * MIB, "the GPU itself is full now")


def test_a_budget_larger_than_the_gpu_is_the_gpu(tmp_path):
    gpu = EmulatedGpu(tmp_path / "gpu0", capacity_mib=200)
    assert DeviceBudget(10_000 * MIB, gpu.memory_info).memory_info() == (200 * MIB, 200 * MIB)
