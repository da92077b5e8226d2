"""``moebus init-model --vision``: a complete LLaVA directory that moebus and transformers both read."""
import json

import numpy as np
import pytest

from moebus import cli
from moebus.common import tiny_model
from moebus.common.checkpoint import Checkpoint
from moebus.common.image_processor import ImageProcessor
from moebus.common.tokenizer import TextTokenizer
from moebus.common.vision_config import load_vision_config
from moebus.cuda.dtypes import to_f32
from moebus.workers.vision_model import load_vision_weights


@pytest.mark.parametrize("tower", ["siglip", "clip"])
def test_cli_writes_a_llava_directory(tmp_path, tower):
    d = tmp_path / tower
    assert cli.main(["init-model", str(d), "--vision", tower, "--arch", "mixtral"]) == 0
    cfg = load_vision_config(d)
    assert cfg.tower == tower and cfg.text_hidden_size == 64
    assert cfg.num_image_tokens == ImageProcessor.from_dir(d).tokens_per_image(cfg.patch_size, cfg.select_strategy)
    ImageProcessor.from_dir(d).check_matches(cfg)
    assert json.loads((d / "config.json").read_text())["image_seq_length"] == cfg.num_image_tokens
    tok = TextTokenizer(d)
    assert tok.encode("a<image>b").count(cfg.image_token_id) == 1
    parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image_url", "image_url": {"url": "x"}}]
    ids = tok.encode_chat([{"role": "user", "content": parts}])
    assert ids.count(cfg.image_token_id) == 2
    assert set(load_vision_weights(d)) >= {"multi_modal_projector.linear_2.bias", "embeddings.position_embedding.weight"}


def test_language_model_is_the_same_with_and_without_vision(tmp_path):
    plain = Checkpoint(tiny_model.init_model(tmp_path / "plain", "qwen3_moe", "tiny"))
    llava = Checkpoint(tiny_model.init_model(tmp_path / "llava", "qwen3_moe", "tiny", vision="siglip"))
    assert llava.config.wrapper == "llava" and any(n.startswith("language_model.model.") for n in llava.names())
    for a, b in zip(plain.expert(2, 3), llava.expert(2, 3)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain.lm_head(), llava.lm_head())
    assert TextTokenizer(tmp_path / "plain").encode("the model") == TextTokenizer(tmp_path / "llava").encode("the model")


def test_a_sharded_preset_writes_the_tower_as_its_own_shard(tmp_path, monkeypatch):
    monkeypatch.setitem(tiny_model.PRESET_SHARDED, "tiny", True)  # the a3b path, at tiny size
    monkeypatch.setattr(tiny_model._Random, "POOL", 1 << 16)  # its number pools too
    d = tiny_model.init_model(tmp_path / "sharded", "qwen3_moe", "tiny", vision="clip")
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["vision_tower.vision_model.embeddings.class_embedding"] == "model-vision.safetensors"
    assert weight_map["language_model.lm_head.weight"] == "model-globals.safetensors"
    weights = load_vision_weights(d)
    assert all(a.dtype == np.uint16 and np.isfinite(to_f32(a)).all() and to_f32(a).std() > 0
               for name, a in weights.items() if a.size > 1)
    assert Checkpoint(d).expert(1, 0)[0].shape == (32, 64)
