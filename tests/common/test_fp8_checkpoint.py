"""FP8 checkpoints as published: the e4m3 codec, block scales with partial edge blocks, the
quantization_config check, and per-expert / fused / sharded layouts all giving the same experts."""
import json
import re
import shutil

import numpy as np
import pytest

from moebus.common import tiny_model
from moebus.common.checkpoint import Checkpoint
from moebus.common.errors import CheckpointError
from moebus.common.fp8_checkpoint import dequantize, parse_quantization
from moebus.common.fp8_convert import fp8_copy
from moebus.common.quant import e4m3_decode, e4m3_encode, fp8_quantize
from moebus.common.safetensors_io import SafetensorsFile, save_file
from moebus.cuda.dtypes import to_f32
from moebus.workers.host_store import HostStore

GOOD = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_e4m3_codec_matches_torch():
    torch = pytest.importorskip("torch")
    codes = np.arange(256, dtype=np.uint8)
    expected = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(e4m3_decode(codes), expected)
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(20000).astype(np.float32) * s for s in (1e-3, 0.05, 1, 60, 300)])
    values = np.concatenate([values, e4m3_decode(codes[:126]) + np.float32(2.0**-12), [448.0, -448.0, 1e9]])
    values = values.astype(np.float32)
    ref = torch.from_numpy(values).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(e4m3_encode(values), ref)


def test_partial_edge_blocks_use_their_own_scale():
    w = np.random.default_rng(1).standard_normal((200, 300)).astype(np.float32)
    w[128:, 256:] *= 50  # the corner block (72 x 44) has a scale of its own
    codes, scale = fp8_quantize(w)
    assert scale.shape == (2, 3)
    values = dequantize(codes, scale, "w")
    np.testing.assert_array_equal(values[128:, 256:], e4m3_decode(codes[128:, 256:]) * scale[1, 2])
    assert np.abs(values - w).max() <= np.abs(w).max() * 2.0**-4
    with pytest.raises(CheckpointError, match=r"needs \(2, 3\)"):
        dequantize(codes, scale[:, :2], "w")


@pytest.mark.parametrize("change, named", [({"quant_method": "gptq"}, "quant_method='gptq'"),
                                           ({"fmt": "e5m2"}, "fmt='e5m2'"),
                                           ({"activation_scheme": "static"}, "activation_scheme='static'"),
                                           ({"weight_block_size": [64, 64]}, "weight_block_size=[64, 64]")])
def test_other_quantization_configs_name_what_is_supported(change, named):
    assert parse_quantization({"quantization_config": GOOD}, "c").modules_to_not_convert == ()
    with pytest.raises(CheckpointError, match=f"{re.escape(named)}.*supported: quant_method 'fp8' with fmt 'e4m3'"):
        parse_quantization({"quantization_config": {**GOOD, **change}}, "c")


def test_fp8_tensor_without_quantization_config_is_refused(tmp_path, model_dirs):
    src = fp8_copy(model_dirs["init_qwen3"], tmp_path / "fp8")
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is FP8 but config.json has no quantization_config"):
        Checkpoint(src).attention(0)


def _blobs(model_dir, dtype):
    ckpt = Checkpoint(model_dir)
    return HostStore(ckpt, range(ckpt.config.num_layers), experts_dtype=dtype).blobs


def _rewrite(src, dst, make_tensors):
    dst.mkdir()
    for path in src.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, dst / path.name)
    f = SafetensorsFile(src / "model.safetensors")
    for fname, tensors in make_tensors(f).items():
        save_file(tensors, dst / fname)
    return dst


def test_sharded_fp8_checkpoint_gives_the_same_blobs(tmp_path, model_dirs):
    src = fp8_copy(model_dirs["init_qwen3"], tmp_path / "fp8")
    names = sorted(SafetensorsFile(src / "model.safetensors").keys())  # a weight and its scale may part
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}

    def shards(f):
        return {fname: {n: (f.array(n), f.dtype_name(n)) for n in part} for fname, part in halves.items()}

    out = _rewrite(src, tmp_path / "sharded", shards)
    (out / "model.safetensors").unlink(missing_ok=True)
    weight_map = {n: fname for fname, part in halves.items() for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    np.testing.assert_array_equal(_blobs(out, "fp8"), _blobs(src, "fp8"))


def _fused(src, dst, cfg):
    """The per-expert bf16 checkpoint with fused (E, 2I, D) gate_up and (E, D, I) down tensors."""
    def tensors(f):
        out = {n: (f.array(n), f.dtype_name(n)) for n in f.keys() if ".experts." not in n}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}.mlp.experts."
            experts = range(cfg.num_experts)
            gate_up = [np.concatenate([f.array(f"{p}{e}.gate_proj.weight"), f.array(f"{p}{e}.up_proj.weight")])
                       for e in experts]
            out[p + "gate_up_proj"] = (np.stack(gate_up), "BF16")
            out[p + "down_proj"] = (np.stack([f.array(f"{p}{e}.down_proj.weight") for e in experts]), "BF16")
        return {"model.safetensors": out}

    return _rewrite(src, dst, tensors)


@pytest.mark.parametrize("inter", [128, 32])
def test_fused_fp8_experts_equal_per_expert_ones(tmp_path, monkeypatch, inter):
    # I = 128: the fused tensor's blocks split cleanly into gate and up, the codes and scales are
    # kept; I = 32: gate and up share blocks, each half is quantized again from the dequantized values
    monkeypatch.setitem(tiny_model.PRESETS, "tiny", {**tiny_model.PRESETS["tiny"], "moe_intermediate_size": inter})
    plain = tiny_model.init_model(tmp_path / "plain", num_layers=2)
    cfg = Checkpoint(plain).config
    per_expert = fp8_copy(plain, tmp_path / "per_expert")
    fused = fp8_copy(_fused(plain, tmp_path / "fused_bf16", cfg), tmp_path / "fused")
    assert Checkpoint(fused).fp8_tensor("model.layers.0.mlp.experts.gate_up_proj") is not None
    if inter % 128 == 0:
        fused_codes, fused_scale = Checkpoint(fused).fp8_tensor("model.layers.1.mlp.experts.gate_up_proj")
        gate_codes, gate_scale = Checkpoint(per_expert).fp8_tensor("model.layers.1.mlp.experts.3.gate_proj.weight")
        np.testing.assert_array_equal(fused_codes[3, :inter], gate_codes)
        np.testing.assert_array_equal(fused_scale[3, :1], gate_scale)
        np.testing.assert_array_equal(_blobs(fused, "fp8"), _blobs(per_expert, "fp8"))
        np.testing.assert_array_equal(_blobs(fused, "bf16"), _blobs(per_expert, "bf16"))
    ckpt = Checkpoint(plain)
    store = HostStore(Checkpoint(fused), range(2), experts_dtype="fp8")
    for key, (layer, expert) in enumerate((layer, e) for layer in range(2) for e in range(cfg.num_experts)):
        for ours, exact in zip(store.layout.dequantize(store.blob(key)), ckpt.expert(layer, expert)):
            exact = to_f32(exact)
            assert np.abs(ours - exact).max() <= np.abs(exact).max() * 2.0**-3
