"""LLaVA config.json keys: which hidden states, how many tokens, which errors."""
import pytest

from moebus.common.errors import CheckpointError
from moebus.common.vision_config import parse_vision_config

TEXT = {"model_type": "qwen3_moe", "hidden_size": 64, "vocab_size": 400}


def llava(**keys):
    vision = keys.pop("vision", {"model_type": "clip_vision_model", "num_hidden_layers": 4, "image_size": 336,
                                 "patch_size": 14})
    return {"architectures": ["LlavaForConditionalGeneration"], "text_config": TEXT, "vision_config": vision,
            "image_token_index": 300, **keys}


def test_llava_defaults_select_the_second_to_last_layer_without_cls():
    cfg = parse_vision_config(llava())
    assert cfg.tower == "clip" and cfg.feature_layers == (3,) and cfg.num_layers_run == 3
    assert cfg.num_image_tokens == 576 and cfg.projector_act == "gelu" and cfg.projector_bias
    assert cfg.hidden_act == "quick_gelu" and cfg.layer_norm_eps == 1e-5 and cfg.image_token_id == 300


def test_siglip_full_and_a_list_of_layers():
    vision = {"model_type": "siglip_vision_model", "num_hidden_layers": 27, "hidden_size": 1152,
              "num_attention_heads": 16, "image_size": 384, "patch_size": 14}
    cfg = parse_vision_config(llava(vision=vision, vision_feature_layer=[0, -1, 5], image_token_id=301,
                                    vision_feature_select_strategy="full", multimodal_projector_bias=False))
    assert cfg.feature_layers == (0, 27, 5) and cfg.num_layers_run == 27 and cfg.projector_in == 3 * 1152
    assert cfg.num_image_tokens == 729 and cfg.hidden_act == "gelu_pytorch_tanh" and not cfg.projector_bias
    assert cfg.image_token_id == 301  # image_token_id wins over image_token_index


def test_a_causal_lm_has_no_vision():
    assert parse_vision_config({"architectures": ["Qwen3MoeForCausalLM"], **TEXT}) is None


@pytest.mark.parametrize("keys, match", [
    (dict(vision_feature_layer=5), "outside the tower"), (dict(vision_feature_layer=-6), "outside the tower"),
    (dict(vision_feature_select_strategy="cls"), "vision_feature_select_strategy"),
    (dict(projector_hidden_act="swiglu"), "projector_hidden_act"),
    (dict(vision={"model_type": "pixtral"}), "pixtral"), (dict(image_token_index=400), "vocabulary"),
    (dict(vision_feature_layer=[]), "empty")])
def test_bad_keys_are_named(keys, match):
    with pytest.raises(CheckpointError, match=match):
        parse_vision_config(llava(**keys))
