"""A Hugging Face model directory as it is: config.json and model.safetensors or a sharded
model.safetensors.index.json, memory-mapped. Tensors come back as zero-copy numpy views in their
stored dtype (bf16 as uint16 bits), each checked against the shape the config implies."""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np

from moebus.common import qwen3vl_checkpoint
from moebus.common.arch import ARCHS, ATTN, DENSE_MLP, GLOBAL, LAYER, Arch
from moebus.common.errors import CheckpointError
from moebus.common.fp8_checkpoint import FP8_DTYPE, SCALE_SUFFIX, dequantize, read_quantization
from moebus.common.model_config import ModelConfig, load_config
from moebus.common.safetensors_io import SafetensorsFile
from moebus.cuda.dtypes import f32_to_bf16, to_f32

WEIGHT_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
# Where a LLaVA checkpoint keeps its language model: Hub layout first, then current transformers.
LLAVA_PREFIXES = {"model.": ("language_model.model.", "model.language_model."),
                  "lm_head.": ("language_model.lm_head.", "lm_head.")}


class Checkpoint:
    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.config: ModelConfig = load_config(self.dir)
        self.arch: Arch = ARCHS[self.config.arch]
        self.quantization = read_quantization(self.dir)  # FP8 (fp8_checkpoint.py) or None
        self._where = self._index_files()
        self._files: dict[str, SafetensorsFile] = {}

    def _index_files(self) -> dict[str, str]:
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                return dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: no valid weight_map: {e}") from e
        if single.is_file():
            return {name: single.name for name in SafetensorsFile(single).keys()}
        raise CheckpointError(f"{self.dir}: neither model.safetensors nor model.safetensors.index.json")

    def _file(self, fname: str) -> SafetensorsFile:
        if fname not in self._files:
            path = self.dir / fname
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in the index but missing")
            self._files[fname] = SafetensorsFile(path)
        return self._files[fname]

    def _resolve(self, name: str) -> str:
        if self.config.wrapper == "qwen3_vl":
            return qwen3vl_checkpoint.resolve(name, self._where)
        if self.config.wrapper != "llava":
            return name
        for short, longs in LLAVA_PREFIXES.items():
            if name.startswith(short):
                for long in longs:
                    if long + name[len(short):] in self._where:
                        return long + name[len(short):]
        return name

    def names(self) -> list[str]:
        """Every stored tensor name as the checkpoint spells it (the vision weights resolve their own)."""
        return list(self._where)

    def has(self, name: str) -> bool:
        return self._resolve(name) in self._where

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The stored tensor ``name`` (a causal-LM name; LLaVA prefixes are resolved)."""
        full = self._resolve(name)
        fname = self._where.get(full)
        if fname is None:
            raise CheckpointError(f"{self.dir}: missing tensor {full}")
        f = self._file(fname)
        if f.dtype_name(full) == FP8_DTYPE:  # dequantized to bf16 at load; experts read fp8_tensor
            codes, scale = self.fp8_tensor(name)
            array = f32_to_bf16(dequantize(codes, scale, full))
        elif f.dtype_name(full) not in WEIGHT_DTYPES:
            raise CheckpointError(f"{f.path}: tensor {full} has dtype {f.dtype_name(full)}, "
                                  f"expected one of {sorted(WEIGHT_DTYPES)}")
        else:
            array = f.array(full)
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{f.path}: tensor {full} has shape {tuple(array.shape)}, "
                                  f"config implies {tuple(shape)}")
        return array

    def fp8_tensor(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(e4m3 codes as uint8, float32 block scales) of a tensor stored as FP8, else None."""
        full = self._resolve(name)
        fname = self._where.get(full)
        if fname is None:
            raise CheckpointError(f"{self.dir}: missing tensor {full}")
        if self._file(fname).dtype_name(full) != FP8_DTYPE:
            return None
        if self.quantization is None:
            raise CheckpointError(f"{self.dir}: tensor {full} is FP8 but config.json has no quantization_config")
        scale = self.tensor(name + SCALE_SUFFIX)
        return self._file(fname).array(full), to_f32(scale)

    @cached_property
    def weight_dtype(self) -> str:
        """'bf16', 'f16' or 'f32': the stored dtype of the embedding table (all weights share it)."""
        full = self._resolve(GLOBAL["embed"])
        if full not in self._where:
            raise CheckpointError(f"{self.dir}: missing tensor {full}")
        return WEIGHT_DTYPES.get(self._file(self._where[full]).dtype_name(full), "?")

    # -- named groups -------------------------------------------------------------------------

    def embedding(self) -> np.ndarray:
        c = self.config
        return self.tensor(GLOBAL["embed"], (c.vocab_size, c.hidden_size))

    def final_norm(self) -> np.ndarray:
        return self.tensor(GLOBAL["norm"], (self.config.hidden_size,))

    def lm_head(self) -> np.ndarray:
        c = self.config
        if c.tie_word_embeddings or not self.has(GLOBAL["lm_head"]):
            return self.embedding()
        return self.tensor(GLOBAL["lm_head"], (c.vocab_size, c.hidden_size))

    def attention(self, layer: int) -> dict[str, np.ndarray]:
        c = self.config
        d, hd = c.hidden_size, c.head_dim
        shapes = {"q": (c.num_heads * hd, d), "k": (c.num_kv_heads * hd, d), "v": (c.num_kv_heads * hd, d),
                  "o": (d, c.num_heads * hd), "attn_norm": (d,), "mlp_norm": (d,)}
        if c.qk_norm:
            shapes.update(q_norm=(hd,), k_norm=(hd,))
        prefix = LAYER.format(i=layer)
        return {key: self.tensor(prefix + ATTN[key], shape) for key, shape in shapes.items()}

    def dense_mlp(self, layer: int) -> dict[str, np.ndarray]:
        c = self.config
        shapes = {"gate": (c.intermediate_size, c.hidden_size), "up": (c.intermediate_size, c.hidden_size),
                  "down": (c.hidden_size, c.intermediate_size)}
        prefix = LAYER.format(i=layer)
        return {key: self.tensor(prefix + DENSE_MLP[key], shape) for key, shape in shapes.items()}

    def router(self, layer: int) -> np.ndarray:
        c = self.config
        return self.tensor(LAYER.format(i=layer) + self.arch.router, (c.num_experts, c.hidden_size))

    def expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) of one expert: per-expert tensors, or slices of fused ones."""
        shapes = self.config.expert_shapes
        prefix = LAYER.format(i=layer)
        per_expert = prefix + self.arch.expert.format(e=expert)
        if self.has(per_expert + self.arch.gate) or not self.arch.fused_gate_up:
            return (self.tensor(per_expert + self.arch.gate, shapes["gate"]),
                    self.tensor(per_expert + self.arch.up, shapes["up"]),
                    self.tensor(per_expert + self.arch.down, shapes["down"]))
        if self.config.wrapper == "qwen3_vl":  # fused experts in either orientation
            return qwen3vl_checkpoint.fused_expert(self, prefix, expert)
        c = self.config
        i, d = c.moe_intermediate_size, c.hidden_size
        gate_up = self.tensor(prefix + self.arch.fused_gate_up, (c.num_experts, 2 * i, d))
        down = self.tensor(prefix + self.arch.fused_down, (c.num_experts, d, i))
        return gate_up[expert, :i], gate_up[expert, i:], down[expert]
