"""LocalModel on the cuda device (numba's simulator here) against the cpu device. The simulator runs
every CUDA thread as a Python thread, so the model is smaller than the "tiny" preset (which takes
about 80 s for three tokens): 2 layers, hidden 32, 4 experts, vocabulary 128."""
import numpy as np
import pytest

from moebus.common import tiny_model
from moebus.workers.local import LocalModel

MICRO = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32,
             max_position_embeddings=64, rope_theta=10000.0)


def init_micro(tmp_path_factory, preset: str = "micro", arch: str = "qwen3_moe", folder: str | None = None,
               **overrides):
    """A micro model (MICRO with ``overrides``, as preset ``preset``) in one safetensors file, in a
    fresh temporary ``folder`` (the preset's name by default)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tiny_model.PRESETS, preset, dict(MICRO, **overrides))
        patch.setitem(tiny_model.PRESET_SHARDED, preset, False)
        return tiny_model.init_model(tmp_path_factory.mktemp(folder or preset), arch, preset)


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    return init_micro(tmp_path_factory)


def test_greedy_tokens_and_logprobs_match_the_cpu_device(micro_model):
    prompt = [5, 17, 42, 9, 77]
    cpu = LocalModel(micro_model, device="cpu", max_context=32).generate(prompt, 3)
    cuda = LocalModel(micro_model, device="cuda", max_context=32).generate(prompt, 3)
    assert cuda.tokens == cpu.tokens
    np.testing.assert_allclose(cuda.logprobs, cpu.logprobs, atol=1e-4)


def test_top_logprobs_come_from_the_device_and_match_the_cpu_device(micro_model):
    from moebus.workers.batch import StepBatch

    batch = StepBatch(slots=[0, 1], starts=[0, 0], lengths=[3, 2], tokens=[5, 17, 42, 9, 77], top_logprobs=4)
    cpu = LocalModel(micro_model, device="cpu", max_context=32).step(batch)
    cuda = LocalModel(micro_model, device="cuda", max_context=32).step(batch)
    np.testing.assert_array_equal(cuda.top_ids, cpu.top_ids)
    np.testing.assert_allclose(cuda.top_logprobs, cpu.top_logprobs, atol=1e-4)
    assert cuda.logits is None  # only (S, n) came back


def test_a_bf16_kv_cache_matches_the_cpu_device_with_one(micro_model):
    # both devices round k and v to bf16 as they store them: the same tokens, logprobs close
    prompt = [5, 17, 42, 9, 77]
    cpu = LocalModel(micro_model, device="cpu", max_context=32, kv_dtype="bf16")
    cuda = LocalModel(micro_model, device="cuda", max_context=32, kv_dtype="bf16")
    assert cuda.stages[0].kv.k[0].dtype == np.uint16
    want, got = cpu.generate(prompt, 3), cuda.generate(prompt, 3)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-3)
