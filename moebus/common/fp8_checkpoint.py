"""FP8 checkpoints as Qwen publishes them (Qwen3-30B-A3B-FP8, Qwen3-VL-30B-A3B-Instruct-FP8):
``config.json`` carries ``quantization_config`` {quant_method: fp8, fmt: e4m3, activation_scheme:
dynamic, weight_block_size: [128, 128]}; each quantized weight ``X`` is stored as F8_E4M3 with a
sibling ``X_scale_inv`` (``…weight_scale_inv``; bf16 or f32) on the 128 x 128 block grid, partial
at the edges. Modules left unconverted (embeddings, norms, lm_head, routers, a vision tower) are
simply stored in bf16, so the loader goes by each tensor's stored dtype.

Experts keep their codes and scales (the fp8 expert blob, quant_layout.py); every other FP8 weight
is dequantized to bf16 at load, as transformers does with ``dequantize=True``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moebus.common.errors import CheckpointError
from moebus.common.quant import BLOCK, block_grid, fp8_dequantize, fp8_quantize

FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
SUPPORTED = ("quant_method 'fp8' with fmt 'e4m3', activation_scheme 'dynamic' and weight_block_size "
             "[128, 128] (Qwen's and DeepSeek's FP8 checkpoints)")
REQUIRED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


@dataclass(frozen=True)
class Fp8Quantization:
    modules_to_not_convert: tuple[str, ...] = ()

    def as_config(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(self.modules_to_not_convert)}


def parse_quantization(raw: dict, where: str) -> Fp8Quantization | None:
    """The checkpoint's quantization from a config.json dict; a CheckpointError naming what is
    supported for anything else."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: quantization_config is not an object; supported: {SUPPORTED}")
    for key, value in REQUIRED.items():
        if q.get(key, None if key == "quant_method" else value) != value:  # transformers' defaults
            raise CheckpointError(f"{where}: quantization_config {key}={q.get(key)!r} is not supported; "
                                  f"supported: {SUPPORTED}")
    if list(q.get("weight_block_size") or [BLOCK, BLOCK]) != [BLOCK, BLOCK]:
        raise CheckpointError(f"{where}: quantization_config weight_block_size={q.get('weight_block_size')!r} "
                              f"is not supported; supported: {SUPPORTED}")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise CheckpointError(f"{where}: quantization_config modules_to_not_convert must be a list of names")
    return Fp8Quantization(tuple(skip))


def read_quantization(model_dir: Path) -> Fp8Quantization | None:
    path = Path(model_dir) / "config.json"
    return parse_quantization(json.loads(path.read_text()), str(path))


def dequantize(codes: np.ndarray, scale_inv: np.ndarray, name: str) -> np.ndarray:
    """float32 of a 2-D or stacked 3-D (E, R, C) FP8 tensor with its block scales."""
    expected = codes.shape[:-2] + block_grid(*codes.shape[-2:])
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; a {tuple(codes.shape)} "
                              f"FP8 tensor in {BLOCK} x {BLOCK} blocks needs {expected}")
    if codes.ndim == 2:
        return fp8_dequantize(codes, scale_inv)
    return np.stack([fp8_dequantize(c, s) for c, s in zip(codes, scale_inv)])


def expert_fp8(ckpt, layer: int, expert: int):
    """[(codes, scale_inv)] of gate, up, down as stored, or None when the experts are not FP8. A
    fused gate_up whose halves do not start on a block edge is dequantized and quantized again."""
    from moebus.common.arch import LAYER

    arch, cfg = ckpt.arch, ckpt.config
    prefix = LAYER.format(i=layer)
    per_expert = prefix + arch.expert.format(e=expert)
    if ckpt.has(per_expert + arch.gate) or not arch.fused_gate_up:
        parts = [ckpt.fp8_tensor(per_expert + n) for n in (arch.gate, arch.up, arch.down)]
        return None if parts[0] is None else parts
    gate_up = ckpt.fp8_tensor(prefix + arch.fused_gate_up)
    if gate_up is None:
        return None
    codes, scales = gate_up[0][expert], gate_up[1][expert]
    down_codes, down_scales = ckpt.fp8_tensor(prefix + arch.fused_down)
    inter = cfg.moe_intermediate_size
    down = (down_codes[expert], down_scales[expert])
    if inter % BLOCK == 0:
        rows = inter // BLOCK
        return [(codes[:inter], scales[:rows]), (codes[inter:], scales[rows:]), down]
    full = fp8_dequantize(codes, scales)
    return [fp8_quantize(full[:inter]), fp8_quantize(full[inter:]), down]


def is_qwen_fp8_weight(name: str) -> bool:
    """The weights Qwen's FP8 checkpoints quantize: the decoder layers' projections (attention,
    dense MLP, experts); not routers, norms, embeddings, lm_head or a vision tower."""
    return "model.layers." in name and name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight",
                                                       "experts.gate_up_proj", "experts.down_proj"))


def fp8_quantize_stack(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp8_quantize of a matrix, or of each matrix of a fused (E, R, C) stack."""
    if array.ndim == 2:
        return fp8_quantize(array)
    parts = [fp8_quantize(a) for a in array]
    return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])


def fp8_stored(named: dict[str, np.ndarray], is_quantized) -> dict[str, tuple[np.ndarray, str]]:
    """Writer side (init-model): ``{name: float32 or bf16 bits}`` -> safetensors entries, the names
    for which ``is_quantized(name)`` holds as F8_E4M3 codes plus f32 ``…_scale_inv``, the rest bf16."""
    from moebus.cuda.dtypes import f32_to_bf16, to_f32

    out = {}
    for name, array in named.items():
        if is_quantized(name):
            codes, scale = fp8_quantize_stack(to_f32(array))
            out[name] = (codes, FP8_DTYPE)
            out[name + SCALE_SUFFIX] = (scale, "F32")
        else:
            out[name] = (array if array.dtype == np.uint16 else f32_to_bf16(array), "BF16")
    return out
