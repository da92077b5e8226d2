"""The tensors of Qwen3-VL's vision tower, mergers and DeepStack mergers, under one canonical naming
(the tower's module names: ``blocks.0.attn.qkv.weight``, ``merger.linear_fc1.weight``, ...). Qwen's
Hub checkpoints and transformers' ``save_pretrained`` keep them under ``model.visual.``; older
exports under ``visual.``."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from moebus.common.checkpoint import Checkpoint
from moebus.common.errors import CheckpointError
from moebus.common.qwen3vl_config import Qwen3VisionConfig

PREFIXES = ("model.visual.", "visual.")
BLOCK = "blocks.{i}."


def _merger_shapes(prefix: str, norm: int, merged: int, out: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "norm.weight": (norm,), prefix + "norm.bias": (norm,),
            prefix + "linear_fc1.weight": (merged, merged), prefix + "linear_fc1.bias": (merged,),
            prefix + "linear_fc2.weight": (out, merged), prefix + "linear_fc2.bias": (out,)}


def expected_shapes(cfg: Qwen3VisionConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor the tower, its merger and DeepStack mergers use."""
    d, inter, p, t = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.temporal_patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, cfg.num_channels, t, p, p), "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (cfg.num_position_embeddings, d)}
    block = {"norm1.weight": (d,), "norm1.bias": (d,), "norm2.weight": (d,), "norm2.bias": (d,),
             "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,), "attn.proj.weight": (d, d),
             "attn.proj.bias": (d,), "mlp.linear_fc1.weight": (inter, d), "mlp.linear_fc1.bias": (inter,),
             "mlp.linear_fc2.weight": (d, inter), "mlp.linear_fc2.bias": (d,)}
    for i in range(cfg.depth):
        shapes.update({BLOCK.format(i=i) + name: shape for name, shape in block.items()})
    merged, out = cfg.merged_hidden, cfg.out_hidden_size
    shapes.update(_merger_shapes("merger.", d, merged, out))
    for j in range(len(cfg.deepstack_layers)):
        shapes.update(_merger_shapes(f"deepstack_merger_list.{j}.", merged, merged, out))
    return shapes


def load_qwen3vl_weights(model_dir: str | Path, cfg: Qwen3VisionConfig) -> dict[str, np.ndarray]:
    """Canonical name -> tensor in its stored dtype, copied into host RAM (the vision zygote holds
    these). Raises CheckpointError naming the file and tensor when one is missing or mis-shaped."""
    ckpt = Checkpoint(model_dir)
    names = set(ckpt.names())
    prefix = next((p for p in PREFIXES if p + "patch_embed.proj.weight" in names), None)
    if prefix is None:
        raise CheckpointError(f"{ckpt.dir}: no vision tensor patch_embed.proj.weight under any of {', '.join(PREFIXES)}")
    return {name: np.array(ckpt.tensor(prefix + name, shape)) for name, shape in expected_shapes(cfg).items()}


def weight_bytes(cfg: Qwen3VisionConfig, itemsize: int = 2, streamed_slots: int = 0) -> int:
    """Bytes of the tower's weights stored with ``itemsize`` bytes per value on its device; with
    ``streamed_slots`` (MOEBUS_VISION_STREAM_LAYERS: workers/tower_stream.py) the blocks past that
    many are in host memory (each slot a block, its q, k, v biases apart and its tensors 256-aligned:
    rounded up here by 4 KiB a block)."""
    shapes = expected_shapes(cfg)
    total = itemsize * sum(int(np.prod(shape)) for shape in shapes.values())
    if not streamed_slots or streamed_slots >= cfg.depth:
        return total
    block = itemsize * sum(int(np.prod(shape)) for name, shape in shapes.items() if name.startswith(BLOCK.format(i=0)))
    return total - (cfg.depth - streamed_slots) * block + streamed_slots * 4096
