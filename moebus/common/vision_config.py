"""The vision half of a LLaVA ``config.json``: which tower (SigLIP or CLIP), its shape, which hidden
states LLaVA feeds the projector and how many image tokens each image becomes.

transformers' ``LlavaModel.get_image_features`` takes ``hidden_states[vision_feature_layer]`` of the
tower (index 0 is the embedding output, index k the output of layer k, negative counts from the
end; a list concatenates several along the features), drops the first position for the
``default`` strategy, and projects. Only the layers up to the deepest selected one ever matter."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moebus.common.errors import CheckpointError

TOWERS = {"siglip_vision_model": "siglip", "clip_vision_model": "clip"}
# transformers' defaults per tower (SiglipVisionConfig / CLIPVisionConfig), for keys a config omits
TOWER_DEFAULTS = {
    "siglip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                   layer_norm_eps=1e-6),
    "clip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5),
}
# LlavaConfig's defaults
LLAVA_DEFAULTS = dict(image_token_index=32000, image_seq_length=576, projector_hidden_act="gelu",
                      vision_feature_select_strategy="default", vision_feature_layer=-2,
                      multimodal_projector_bias=True)
ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu", "silu", "relu")


@dataclass(frozen=True)
class VisionConfig:
    tower: str  # "siglip" | "clip"
    hidden_size: int
    intermediate_size: int
    num_layers_run: int  # encoder layers that run: up to the deepest selected feature layer
    num_heads: int
    patch_size: int
    image_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...]  # hidden-state indices, resolved to >= 0 (0: embeddings)
    select_strategy: str  # "default" drops position 0, "full" keeps every position
    projector_act: str
    projector_bias: bool
    image_token_id: int
    num_image_tokens: int  # tokens per image after selection (what the placeholder expands to)
    text_hidden_size: int
    num_layers: int = 0  # encoder layers in the checkpoint
    image_seq_length: int = 0  # the config's own figure (transformers does not rely on it either)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Positions through the encoder: the patches, plus CLIP's class position."""
        return self.num_patches + (1 if self.tower == "clip" else 0)

    @property
    def projector_in(self) -> int:
        return self.hidden_size * len(self.feature_layers)


def _feature_layers(value, num_layers: int, where: str) -> tuple[int, ...]:
    layers = value if isinstance(value, list) else [value]
    out = []
    for layer in layers:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise CheckpointError(f"{where}: vision_feature_layer must be an int or a list of ints, got {value!r}")
        resolved = layer if layer >= 0 else num_layers + 1 + layer
        if not 0 <= resolved <= num_layers:
            raise CheckpointError(f"{where}: vision_feature_layer {layer} is outside the tower's "
                                  f"{num_layers + 1} hidden states")
        out.append(resolved)
    if not out:
        raise CheckpointError(f"{where}: vision_feature_layer is an empty list")
    return tuple(out)


def _tower(vision: dict, where: str) -> tuple[str, dict]:
    model_type = vision.get("model_type") or "clip_vision_model"  # LlavaConfig's default tower
    tower = TOWERS.get(model_type)
    if tower is None:
        raise CheckpointError(f"{where}: vision tower {model_type!r} is not supported (supported: {sorted(TOWERS)})")
    merged = dict(TOWER_DEFAULTS[tower])
    merged.update({k: v for k, v in vision.items() if v is not None})
    return tower, merged


def parse_vision_config(raw: dict, where: str = "config.json") -> VisionConfig | None:
    """VisionConfig of a LLaVA config.json dict; None when the model has no vision tower."""
    if (raw.get("architectures") or [None])[0] != "LlavaForConditionalGeneration" or "vision_config" not in raw:
        return None
    top = {**LLAVA_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    tower, v = _tower(raw.get("vision_config") or {}, where)
    num_layers = int(v["num_hidden_layers"])
    layers = _feature_layers(top["vision_feature_layer"], num_layers, where)
    strategy = top["vision_feature_select_strategy"]
    if strategy not in ("default", "full"):
        raise CheckpointError(f"{where}: vision_feature_select_strategy {strategy!r} (expected 'default' or 'full')")
    acts = (("vision_config.hidden_act", v["hidden_act"]), ("projector_hidden_act", top["projector_hidden_act"]))
    for key, act in acts:
        if act not in ACTIVATIONS:
            raise CheckpointError(f"{where}: {key} {act!r} is not supported (supported: {ACTIVATIONS})")
    hidden, heads = int(v["hidden_size"]), int(v["num_attention_heads"])
    if hidden % heads:
        raise CheckpointError(f"{where}: vision hidden_size {hidden} is not a multiple of {heads} heads")
    image_size, patch = int(v["image_size"]), int(v["patch_size"])
    positions = (image_size // patch) ** 2 + (1 if tower == "clip" else 0)
    text = raw.get("text_config") or {}
    if text.get("hidden_size") is None:
        raise CheckpointError(f"{where}: missing key 'text_config.hidden_size'")
    token = int(raw.get("image_token_id", top["image_token_index"]))
    if not 0 <= token < int(text.get("vocab_size") or token + 1):
        raise CheckpointError(f"{where}: image token id {token} is outside the vocabulary of {text['vocab_size']}")
    return VisionConfig(
        tower=tower, hidden_size=hidden, intermediate_size=int(v["intermediate_size"]),
        num_layers_run=max(layers), num_heads=heads, patch_size=patch, image_size=image_size,
        num_channels=int(v["num_channels"]), layer_norm_eps=float(v["layer_norm_eps"]), hidden_act=v["hidden_act"],
        feature_layers=layers, select_strategy=strategy, projector_act=top["projector_hidden_act"],
        projector_bias=bool(top["multimodal_projector_bias"]), image_token_id=token,
        num_image_tokens=positions - (1 if strategy == "default" else 0), text_hidden_size=int(text["hidden_size"]),
        num_layers=num_layers, image_seq_length=int(top["image_seq_length"]))


def load_vision_config(model_dir: str | Path):
    """The vision tower's config of a model directory: a VisionConfig (LLaVA), a Qwen3VisionConfig
    (Qwen3-VL-MoE, common/qwen3vl_config.py); None when the model has no vision tower."""
    from moebus.common.qwen3vl_config import is_qwen3vl, parse_qwen3_vision_config

    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
    if is_qwen3vl(raw):
        return parse_qwen3_vision_config(raw, str(path))
    return parse_vision_config(raw, str(path))
