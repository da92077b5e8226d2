"""An image prompt through LocalModel on the cuda device (numba's simulator here) against the cpu
device: the tower's kernels and stage 0's scatter of the image embeddings, on a micro model."""
import numpy as np
import pytest

from moebus.common import tiny_model, tiny_vision
from moebus.workers.local import LocalModel

MICRO = dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32,
             max_position_embeddings=64, rope_theta=10000.0)
# 16 px / 8 px: 4 patches, the CLIP class position dropped by the default strategy: 4 image tokens
MICRO_TOWER = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                   patch_size=8)


@pytest.fixture(scope="module")
def micro_llava(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tiny_model.PRESETS, "micro", MICRO)
        patch.setitem(tiny_model.PRESET_SHARDED, "micro", False)
        patch.setitem(tiny_vision.VISION_PRESETS, "micro", MICRO_TOWER)
        return tiny_model.init_model(tmp_path_factory.mktemp("micro_llava"), "qwen3_moe", "micro", vision="clip")


def test_image_prompt_logits_match_the_cpu_device(micro_llava):
    cpu = LocalModel(micro_llava, device="cpu", max_context=32)
    cfg = cpu.vision_config
    assert cfg.num_image_tokens == 4
    prompt = [5, 17] + [cfg.image_token_id] * cfg.num_image_tokens + [42, 9]
    pixels = np.random.default_rng(0).uniform(-1, 1, (1, 3, cfg.image_size, cfg.image_size)).astype(np.float32)
    ref = cpu.prefill_logits([prompt], images=[pixels])
    ours = LocalModel(micro_llava, device="cuda", max_context=32).prefill_logits([prompt], images=[pixels])
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    text_only = cpu.prefill_logits([[5, 17] + [3] * cfg.num_image_tokens + [42, 9]])
    assert np.abs(ref - text_only).max() > 1e-3  # the image reached the logits
