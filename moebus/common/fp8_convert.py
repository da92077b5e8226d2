"""Checkpoint copies for tests and benchmarks: any bf16/f32 model directory as an FP8 checkpoint in
Qwen's format (``fp8_copy``), and an FP8 checkpoint dequantized into float32 safetensors that
transformers loads as a plain model (``dequantized_copy``: the reference of the fidelity tests)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from moebus.common.fp8_checkpoint import (FP8_DTYPE, SCALE_SUFFIX, Fp8Quantization, dequantize, fp8_stored,
                                          is_qwen_fp8_weight)
from moebus.common.safetensors_io import SafetensorsFile, save_file
from moebus.cuda.dtypes import bf16_to_f32, f32_to_bf16, to_f32

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _shards(src: Path) -> list[str]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _copy_other_files(src: Path, dst: Path, shards: list[str]) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name not in shards and path.name not in WEIGHT_FILES + ("config.json",):
            shutil.copy(path, dst / path.name)
    return json.loads((src / "config.json").read_text())


def _write(dst: Path, shard_tensors: dict[str, dict], config: dict, indexed: bool) -> None:
    weight_map = {}
    for fname, tensors in shard_tensors.items():
        save_file(tensors, dst / fname)
        weight_map.update({name: fname for name in tensors})
    if indexed:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def fp8_copy(src: str | Path, dst: str | Path) -> Path:
    """``src`` with its decoder projections (experts too, per-expert or fused) as FP8 e4m3 with f32
    block scales and ``quantization_config`` in config.json; the rest in bf16."""
    src, dst = Path(src), Path(dst)
    shards = _shards(src)
    config = _copy_other_files(src, dst, shards)
    out = {}
    for fname in shards:
        f = SafetensorsFile(src / fname)
        out[fname] = fp8_stored({name: f.array(name) for name in f.keys()}, is_qwen_fp8_weight)
    config.pop("torch_dtype", None)
    config.update(torch_dtype="bfloat16", quantization_config=Fp8Quantization(("lm_head",)).as_config())
    _write(dst, out, config, (src / "model.safetensors.index.json").is_file())
    return dst


def dequantized_copy(src: str | Path, dst: str | Path, experts_exact: bool = True, attention_exact: bool = False) -> Path:
    """An FP8 checkpoint as float32 tensors, no quantization_config: what moebus computes with.
    Non-expert FP8 weights are rounded to bf16 (moebus dequantizes them to bf16 at load); experts
    stay exact when ``experts_exact`` (fp8 experts compute with the codes times their scales), the
    attention projections when ``attention_exact`` (attention.dtype fp8 reads them so too)."""
    src, dst = Path(src), Path(dst)
    shards = _shards(src)
    config = _copy_other_files(src, dst, shards)
    out = {}
    for fname in shards:
        f = SafetensorsFile(src / fname)
        tensors = {}
        for name in f.keys():
            if name.endswith(SCALE_SUFFIX):
                continue
            if f.dtype_name(name) != FP8_DTYPE:
                tensors[name] = (to_f32(f.array(name)), "F32")
                continue
            values = dequantize(f.array(name), to_f32(f.array(name + SCALE_SUFFIX)), name)
            exact = (experts_exact and ".experts." in name) or (attention_exact and ".self_attn." in name)
            if not exact:
                values = bf16_to_f32(f32_to_bf16(values))
            tensors[name] = (np.ascontiguousarray(values, np.float32), "F32")
        out[fname] = tensors
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    _write(dst, out, config, (src / "model.safetensors.index.json").is_file())
    return dst
