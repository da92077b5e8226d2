import json
import shutil

import numpy as np
import pytest

from moebus.common.checkpoint import Checkpoint
from moebus.common.errors import CheckpointError
from moebus.common.model_config import parse_config
from moebus.common.safetensors_io import SafetensorsFile, save_file
from moebus.cuda.dtypes import bf16_to_f32, f32_to_bf16


def test_bf16_round_trip_and_rounding():
    x = np.array([1.0, -2.5, 3.14159, 1e-3, 65504.0], dtype=np.float32)
    back = bf16_to_f32(f32_to_bf16(x))
    assert np.all(np.abs(back - x) <= np.abs(x) * 2 ** -8)
    assert f32_to_bf16(np.array([1.0 + 2 ** -8], np.float32))[0] == f32_to_bf16(np.array([1.0], np.float32))[0]


def test_safetensors_write_read_is_zero_copy_view(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = f32_to_bf16(np.ones(5, np.float32))
    save_file({"a": (a, "F32"), "b": (b, "BF16")}, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert np.array_equal(f.array("a"), a) and f.dtype_name("b") == "BF16"
    assert not f.array("a").flags.owndata


def test_reads_hub_and_current_transformers_configs(model_dirs):
    hub = Checkpoint(model_dirs["init_qwen3"]).config  # written with Hub key names
    new = Checkpoint(model_dirs["hf_qwen3_f32"]).config  # written by transformers 5
    assert hub.num_experts == 8 and new.num_experts == 8
    assert hub.rope_theta == 10000.0 and new.rope_theta > 0
    assert new.dense_layers == (1,) and hub.dense_layers == ()
    mix = Checkpoint(model_dirs["init_mixtral"]).config
    assert mix.arch == "mixtral" and mix.norm_topk_prob and not mix.qk_norm


def test_sharded_checkpoint(tmp_path, model_dirs):
    src = Checkpoint(model_dirs["init_qwen3"])
    names = list(src._where)
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(model_dirs["init_qwen3"] / "config.json", out)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: (np.array(src.tensor(n)), "BF16") for n in part}, out / fname)
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = Checkpoint(out)
    assert np.array_equal(sharded.expert(2, 5)[2], src.expert(2, 5)[2])
    assert sharded.weight_dtype == "bf16"


def _copy_without(src, dst, drop=None, reshape=None):
    ck = Checkpoint(src)
    tensors = {}
    for n in ck._where:
        if n == drop:
            continue
        a = np.array(ck.tensor(n))
        tensors[n] = (a[:-1] if n == reshape else a, "BF16")
    dst.mkdir()
    shutil.copy(src / "config.json", dst)
    save_file(tensors, dst / "model.safetensors")
    return Checkpoint(dst)


def test_missing_tensor_and_shape_mismatch_name_file_and_tensor(tmp_path, model_dirs):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    ck = _copy_without(model_dirs["init_qwen3"], tmp_path / "a", drop=name)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.experts\.3\.up_proj"):
        ck.expert(1, 3)
    ck = _copy_without(model_dirs["init_qwen3"], tmp_path / "b", reshape="model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.q_proj"):
        ck.attention(0)


def test_unsupported_architecture_and_rope():
    with pytest.raises(CheckpointError, match="LlamaForCausalLM.*not supported"):
        parse_config({"architectures": ["LlamaForCausalLM"]})
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
           "num_hidden_layers": 1, "vocab_size": 10, "num_experts": 2, "num_experts_per_tok": 1,
           "moe_intermediate_size": 4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 1e6}
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        parse_config(cfg)


def test_llava_wrapper_language_part_in_both_layouts(tmp_path, model_dirs):
    src = Checkpoint(model_dirs["init_qwen3"])
    inner = json.loads((model_dirs["init_qwen3"] / "config.json").read_text())
    for layout, (model_prefix, head_prefix) in {"hub": ("language_model.model.", "language_model.lm_head."),
                                                "v5": ("model.language_model.", "lm_head.")}.items():
        out = tmp_path / layout
        out.mkdir()
        tensors = {}
        for n in src._where:
            new = model_prefix + n[len("model."):] if n.startswith("model.") else head_prefix + n[len("lm_head."):]
            tensors[new] = (np.array(src.tensor(n)), "BF16")
        tensors["multi_modal_projector.linear_1.weight"] = (np.zeros((2, 2), np.float32), "F32")
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"],
                                                     "text_config": inner, "vision_config": {"hidden_size": 8}}))
        ck = Checkpoint(out)
        assert ck.config.wrapper == "llava"
        assert np.array_equal(ck.lm_head(), src.lm_head())
        assert np.array_equal(ck.expert(3, 7)[0], src.expert(3, 7)[0])
