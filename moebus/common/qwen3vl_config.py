"""Qwen3-VL-MoE's ``config.json`` (``Qwen3VLMoeForConditionalGeneration``, model_type
``qwen3_vl_moe``): the Qwen3-MoE language model under ``text_config`` with interleaved M-RoPE, and
the vision tower under ``vision_config``. Keys appear in the Hub's spelling (``num_experts``,
``rope_scaling`` + ``rope_theta``) or in what current transformers writes (``num_local_experts``,
``rope_parameters``); both are read.

M-RoPE: every token has three positions (temporal, height, width); rotary frequency ``i`` of a head
turns by the height position when ``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, by the width
position when ``i % 3 == 2`` and ``i < 3 * mrope_section[2]``, else by the temporal one (transformers'
``Qwen3VLMoeTextRotaryEmbedding.recomposition_frequencies``; it is interleaved whatever
``mrope_interleaved`` says, so moebus does the same)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moebus.common.errors import CheckpointError

ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"
MODEL_TYPES = ("qwen3_vl_moe",)
# Qwen3VLMoeVisionConfig's defaults, for keys a config omits
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                       num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       out_hidden_size=3584, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
TOKEN_DEFAULTS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                      vision_end_token_id=151653)
VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "gelu_new", "silu", "quick_gelu", "relu")
DEFAULT_MROPE_SECTION = (24, 20, 20)


def is_qwen3vl(raw: dict) -> bool:
    archs = raw.get("architectures") or []
    return (archs[:1] == [ARCHITECTURE]) or (not archs and raw.get("model_type") in MODEL_TYPES)


def rope_params(text: dict) -> dict:
    """The text config's rope settings in one dict, whichever spelling the file uses."""
    params = dict(text.get("rope_scaling") or {})
    params.update(text.get("rope_parameters") or {})
    if "rope_theta" not in params and text.get("rope_theta") is not None:
        params["rope_theta"] = text["rope_theta"]
    return params


def text_config(raw: dict, where: str) -> dict:
    """``text_config`` as a Qwen3-MoE causal LM's config.json would say it: rope type ``default``
    (M-RoPE's frequencies are the default ones), ``norm_topk_prob`` true (Qwen3-VL-MoE's router
    always renormalizes its top-k weights), the top level's ``tie_word_embeddings``."""
    text = dict(raw.get("text_config") or {})
    if not text:
        raise CheckpointError(f"{where}: missing key 'text_config'")
    params = rope_params(text)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "mrope"):
        raise CheckpointError(f"{where}: text_config rope type {kind!r} is not supported (default / mrope)")
    params["rope_type"] = "default"
    text.pop("rope_scaling", None)
    text["rope_parameters"] = params
    text["norm_topk_prob"] = True
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", text["tie_word_embeddings"]))
    text.setdefault("eos_token_id", raw.get("eos_token_id"))
    return text


def mrope_section(raw: dict, head_dim: int, where: str) -> tuple[int, int, int]:
    section = tuple(int(s) for s in rope_params(raw.get("text_config") or {}).get("mrope_section")
                    or DEFAULT_MROPE_SECTION)
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise CheckpointError(f"{where}: mrope_section {list(section)} must be three numbers adding up to "
                              f"head_dim / 2 = {head_dim // 2}")
    return section


@dataclass(frozen=True)
class Qwen3VisionConfig:
    tower: str  # "qwen3_vl" (VisionModel dispatch and the vision worker's kind)
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int  # spatial_merge_size: merge_size^2 patches become one image token
    out_hidden_size: int  # the language model's hidden size
    num_position_embeddings: int
    deepstack_layers: tuple[int, ...]  # blocks whose merged output is added after LM layers 0, 1, ...
    hidden_act: str
    rope_theta: float
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    text_hidden_size: int
    layer_norm_eps: float = 1e-6
    num_image_tokens: int = 0  # not fixed: it follows each image's size (tokens_for_grid)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x temporal x patch x patch."""
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)

    @property
    def merged_hidden(self) -> int:
        return self.hidden_size * self.merge_size ** 2

    def tokens_for_grid(self, grid_h: int, grid_w: int) -> int:
        return grid_h * grid_w // self.merge_size ** 2


def parse_qwen3_vision_config(raw: dict, where: str = "config.json") -> Qwen3VisionConfig:
    v = {**VISION_DEFAULTS, **{k: x for k, x in (raw.get("vision_config") or {}).items() if x is not None}}
    top = {**TOKEN_DEFAULTS, **{k: x for k, x in raw.items() if x is not None}}
    text = raw.get("text_config") or {}
    if text.get("hidden_size") is None:
        raise CheckpointError(f"{where}: missing key 'text_config.hidden_size'")
    hidden, heads = int(v["hidden_size"]), int(v.get("num_heads") or v.get("num_attention_heads"))
    depth = int(v.get("depth") or v.get("num_hidden_layers"))
    if hidden % heads or (hidden // heads) % 4:
        raise CheckpointError(f"{where}: vision hidden_size {hidden} over {heads} heads: the head size must be a "
                              "multiple of 4 (2-D rotary)")
    if v["hidden_act"] not in VISION_ACTIVATIONS:
        raise CheckpointError(f"{where}: vision_config.hidden_act {v['hidden_act']!r} is not supported")
    deepstack = tuple(int(i) for i in v["deepstack_visual_indexes"])
    if any(not 0 <= i < depth for i in deepstack):
        raise CheckpointError(f"{where}: deepstack_visual_indexes {list(deepstack)} outside the {depth} blocks")
    if int(text.get("num_hidden_layers") or len(deepstack)) < len(deepstack):
        raise CheckpointError(f"{where}: {len(deepstack)} DeepStack features for fewer language model layers")
    side = int(int(v["num_position_embeddings"]) ** 0.5)
    if side * side != int(v["num_position_embeddings"]):
        raise CheckpointError(f"{where}: num_position_embeddings {v['num_position_embeddings']} is not a square")
    if int(v["out_hidden_size"]) != int(text["hidden_size"]):
        raise CheckpointError(f"{where}: vision out_hidden_size {v['out_hidden_size']} differs from the language "
                              f"model's hidden_size {text['hidden_size']}")
    rope = v.get("rope_parameters") or {}
    return Qwen3VisionConfig(
        tower="qwen3_vl", depth=depth, hidden_size=hidden, intermediate_size=int(v["intermediate_size"]),
        num_heads=heads, num_channels=int(v["in_channels"]), patch_size=int(v["patch_size"]),
        temporal_patch_size=int(v["temporal_patch_size"]), merge_size=int(v["spatial_merge_size"]),
        out_hidden_size=int(v["out_hidden_size"]), num_position_embeddings=int(v["num_position_embeddings"]),
        deepstack_layers=deepstack, hidden_act=v["hidden_act"], rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=int(top["image_token_id"]), video_token_id=int(top["video_token_id"]),
        vision_start_token_id=int(top["vision_start_token_id"]), vision_end_token_id=int(top["vision_end_token_id"]),
        text_hidden_size=int(text["hidden_size"]))


def load_raw(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
