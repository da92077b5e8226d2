"""The vision tower's and projector's tensors of a LLaVA checkpoint, in whichever layout it was
written, under one canonical naming (the tower's own module names, as transformers 5 keeps them):

- Hub checkpoints: ``vision_tower.vision_model.*`` and ``multi_modal_projector.*``;
- transformers 5 ``save_pretrained``: ``vision_tower.*`` (no ``vision_model.``);
- the in-memory layout: ``model.vision_tower.*`` and ``model.multi_modal_projector.*``.

Only the encoder layers that LLaVA's feature selection needs are read; post_layernorm and the
pooling head never are."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from moebus.common.checkpoint import Checkpoint
from moebus.common.errors import CheckpointError
from moebus.common.vision_config import VisionConfig, load_vision_config

TOWER_PREFIXES = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                  "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
PROJECTOR = "multi_modal_projector."
LAYER = "encoder.layers.{i}."


def expected_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor the tower and projector use."""
    d, inter, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.patch_embedding.weight": (d, cfg.num_channels, p, p),
        "embeddings.position_embedding.weight": (cfg.num_positions, d),
    }
    if cfg.tower == "siglip":
        shapes["embeddings.patch_embedding.bias"] = (d,)
    else:
        shapes.update({"embeddings.class_embedding": (d,), "pre_layrnorm.weight": (d,), "pre_layrnorm.bias": (d,)})
    per_layer = {"layer_norm1.weight": (d,), "layer_norm1.bias": (d,), "layer_norm2.weight": (d,),
                 "layer_norm2.bias": (d,), "mlp.fc1.weight": (inter, d), "mlp.fc1.bias": (inter,),
                 "mlp.fc2.weight": (d, inter), "mlp.fc2.bias": (d,)}
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        per_layer.update({f"self_attn.{proj}.weight": (d, d), f"self_attn.{proj}.bias": (d,)})
    for i in range(cfg.num_layers_run):
        shapes.update({LAYER.format(i=i) + name: shape for name, shape in per_layer.items()})
    text = cfg.text_hidden_size
    shapes.update({PROJECTOR + "linear_1.weight": (text, cfg.projector_in),
                   PROJECTOR + "linear_2.weight": (text, text)})
    if cfg.projector_bias:
        shapes.update({PROJECTOR + "linear_1.bias": (text,), PROJECTOR + "linear_2.bias": (text,)})
    return shapes


def _prefix(names: set[str], prefixes: tuple[str, ...], probe: str, where: Path) -> str:
    for prefix in prefixes:
        if prefix + probe in names:
            return prefix
    raise CheckpointError(f"{where}: no vision tensor {probe} under any of {', '.join(prefixes)}")


def load_vision_weights(model_dir: str | Path, cfg: VisionConfig | None = None) -> dict[str, np.ndarray]:
    """Canonical name -> tensor in its stored dtype (bf16 as uint16 bits), copied into host RAM (the
    vision zygote holds these, so a forked worker never touches the files). Raises CheckpointError
    naming the file and tensor when one is missing or mis-shaped."""
    cfg = cfg or load_vision_config(model_dir)
    if cfg is None:
        raise CheckpointError(f"{model_dir}: the model has no vision tower")
    if cfg.tower == "qwen3_vl":
        from moebus.workers.qwen3vl_weights import load_qwen3vl_weights

        return load_qwen3vl_weights(model_dir, cfg)
    ckpt = Checkpoint(model_dir)
    names = set(ckpt.names())
    tower = _prefix(names, TOWER_PREFIXES, "embeddings.patch_embedding.weight", ckpt.dir)
    projector = _prefix(names, PROJECTOR_PREFIXES, "linear_1.weight", ckpt.dir)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        full = projector + name[len(PROJECTOR):] if name.startswith(PROJECTOR) else tower + name
        weights[name] = np.array(ckpt.tensor(full, shape))
    return weights
