"""The experts' dtype decides the slot size: the same MiB holds ~2x (fp8) or ~3.5x (int4) the bf16
experts, a miss moves the quantized blob, the VRAM report and stats say which dtype, and the
forward pass does not depend on what is resident in any dtype."""
import numpy as np
import pytest

from moebus.common.checkpoint import Checkpoint
from moebus.common.errors import ConfigError
from moebus.common.quant import int4_relative_error
from moebus.common.quant_layout import ExpertLayout, expert_layout
from moebus.common.settings import load_settings
from moebus.cuda.backends.cpu import CpuBackend
from moebus.cuda.memory.ledger import MIB, EmulatedGpu
from moebus.workers.experts import build_expert_cache
from moebus.workers.local import LocalModel

DTYPES = ("bf16", "fp8", "int4")


def test_a3b_experts_fit_2x_and_3_5x_in_the_same_bytes():
    bf16_bytes = 3 * 2048 * 768 * 2  # Qwen3-30B-A3B: D 2048, I 768
    assert bf16_bytes / ExpertLayout("fp8", 2048, 768).blob_bytes >= 1.95
    assert bf16_bytes / ExpertLayout("int4", 2048, 768).blob_bytes >= 3.5
    assert expert_layout("bf16", 2048, 768) is None
    with pytest.raises(ValueError, match="multiples of 16"):
        ExpertLayout("fp8", 2048, 770)


def test_4bit_form_is_the_one_with_the_lower_measured_error():
    rng = np.random.default_rng(0)
    for w in (rng.standard_normal((256, 512)), rng.standard_t(4, (256, 512)), rng.laplace(size=(256, 512))):
        errors = int4_relative_error(w.astype(np.float32))
        assert errors["asymmetric"] < errors["symmetric"]


def _cache(model_dir, dtype, capacity_bytes, gpu=None):
    ckpt = Checkpoint(model_dir)
    return build_expert_cache(ckpt, range(ckpt.config.num_layers), CpuBackend(), capacity_bytes=capacity_bytes,
                              elastic=gpu is not None, gpu=gpu, experts_dtype=dtype, preload=False)


def test_same_capacity_holds_more_quantized_experts_and_misses_move_their_bytes(model_dirs):
    capacity = 96 * 1024
    caches = {d: _cache(model_dirs["init_qwen3"], d, capacity) for d in DTYPES}
    for dtype, cache in caches.items():
        assert cache.arena.slot_bytes == cache.store.blob_bytes
        assert cache.num_slots == capacity // cache.store.blob_bytes
        assert cache.stats()["experts_dtype"] == dtype
        assert cache.stats()["expert_slot_bytes"] == cache.store.blob_bytes
        cache.acquire(0, np.array([1, 2]))
        assert cache.h2d_bytes == 2 * cache.store.blob_bytes
    bf16 = caches["bf16"].num_slots
    assert caches["fp8"].num_slots >= 15 / 8 * bf16  # 1.98x the experts, less the last partial slot
    assert caches["int4"].num_slots >= 3 * bf16  # tiny D = 64: a group is half full; A3B: 3.56x


@pytest.mark.parametrize("dtype", ["fp8", "int4"])
def test_vram_reserve_shrinks_and_bare_regrows_in_slots_of_the_dtype(tmp_path, demo_model, dtype):
    gpu = EmulatedGpu(tmp_path / "gpu0", capacity_mib=16)
    ckpt = Checkpoint(demo_model)
    cache = build_expert_cache(ckpt, range(2), CpuBackend(), capacity_bytes=8 * MIB, elastic=True, gpu=gpu,
                               experts_dtype=dtype, preload=False)
    full = cache.report()
    assert full["expert_slots"] == 8 * MIB // cache.store.blob_bytes
    assert full["expert_slots"] >= (1.95 if dtype == "fp8" else 3.5) * 8 * MIB // (3 * 256 * 128 * 2)
    shrunk = cache.resize(full["free_mib"] + 4)  # two 2 MiB segments go back
    assert shrunk["expert_cache_mib"] == 4 and shrunk["expert_slots"] == 4 * MIB // cache.store.blob_bytes
    assert cache.resize(None) == full


@pytest.mark.parametrize("dtype", ["fp8", "int4"])
def test_greedy_tokens_and_logprobs_identical_with_all_and_10_percent_resident(model_dirs, dtype):
    full = LocalModel(model_dirs["init_qwen3"], experts_dtype=dtype)
    small = LocalModel(model_dirs["init_qwen3"], cache_fraction=0.10, experts_dtype=dtype)
    prompt = [5, 17, 99, 3, 42, 7, 250, 31, 8]
    a, b = full.generate(prompt, 16), small.generate(prompt, 16)
    assert a.tokens == b.tokens
    assert np.array_equal(np.array(a.logprobs), np.array(b.logprobs))
    assert small.stages[0].experts.misses > small.stages[0].experts.num_slots


def test_experts_dtype_setting_from_environment(monkeypatch):
    assert load_settings().experts.dtype == "bf16"
    monkeypatch.setenv("MOEBUS_EXPERTS__DTYPE", "int4")
    assert load_settings().experts.dtype == "int4"
    monkeypatch.setenv("MOEBUS_EXPERTS__DTYPE", "q8")
    with pytest.raises(ConfigError, match="experts.dtype"):
        load_settings()


@pytest.mark.parametrize("dtype", ["fp8", "int4"])
def test_long_prefill_borrows_fp8_and_int4_slots_and_runs_in_pieces(model_dirs, dtype):
    from moebus.workers.batch import StepBatch
    from moebus.workers.cache_sizing import ScratchBudget

    full = LocalModel(model_dirs["init_qwen3"], experts_dtype=dtype)
    small = LocalModel(model_dirs["init_qwen3"], cache_fraction=0.5, experts_dtype=dtype)
    stage = small.stages[0]
    stage.scratch = ScratchBudget(stage.cfg, tokens=4)
    cache = stage.experts
    slots_before = cache.num_slots
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11]]
    batch = StepBatch(slots=[0, 1], starts=[0, 0], lengths=[len(p) for p in prompts], tokens=sum(prompts, []))
    lendable = (slots_before - cache.min_slots) * cache.arena.slot_bytes  # slots of the dtype's size
    assert stage.scratch.tokens_within(lendable) < batch.num_tokens  # so it must run in pieces
    got = small.step(batch, want_logits=True).logits
    assert np.abs(got - full.prefill_logits(prompts)).max() < 1e-4
    assert cache.loaned_from is None and cache.num_slots == slots_before  # the loan came back
