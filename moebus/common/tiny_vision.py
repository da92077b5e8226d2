"""The vision half of ``moebus init-model --vision siglip|clip``: a LLaVA config around the language
model's, random tower and projector weights in the Hub layout (``vision_tower.vision_model.*``,
``multi_modal_projector.*``) and the processor config that transformers' LlavaProcessor writes.

Residual branches are scaled by 1 / sqrt(2 layers) so the hidden states keep unit size however
deep the tower is, and the projector maps them to text-embedding size (the demo must not overflow)."""
from __future__ import annotations

import math

import numpy as np

from moebus.common.image_processor import BICUBIC, CLIP_MEAN, CLIP_STD, STANDARD_MEAN, STANDARD_STD
from moebus.common.vision_config import TOWER_DEFAULTS

# tower shapes per language-model preset
VISION_PRESETS = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 image_size=32, patch_size=8),
    # fast on a 2-core CPU: 196 patches of 16 px over 4 layers
    "demo": dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3,
                 image_size=224, patch_size=16),
    # SigLIP-so400m's shape (27 layers, 729 patches of 14 px at 384 px)
    "a3b": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                image_size=384, patch_size=14),
}
# what LLaVA checkpoints of each tower usually select: SigLIP's last hidden state and every patch
# (LLaVA-OneVision), CLIP's second-to-last without the class position (LLaVA-1.5)
SELECTION = {"siglip": (-1, "full"), "clip": (-2, "default")}
MODEL_TYPES = {"siglip": "siglip_vision_model", "clip": "clip_vision_model"}


def llava_config(text_cfg: dict, tower: str, preset: str, image_token_id: int) -> dict:
    if tower not in MODEL_TYPES:
        raise ValueError(f"unknown vision tower {tower!r} (choose from {sorted(MODEL_TYPES)})")
    shape = VISION_PRESETS.get(preset, VISION_PRESETS["tiny"])  # a preset of its own (tests) takes the tiny tower
    vision = {**{k: TOWER_DEFAULTS[tower][k] for k in ("hidden_act", "layer_norm_eps", "num_channels")},
              **shape, "model_type": MODEL_TYPES[tower]}
    if tower == "siglip":
        vision["vision_use_head"] = False  # LLaVA never uses the pooling head: none is written
    layer, strategy = SELECTION[tower]
    patches = (shape["image_size"] // shape["patch_size"]) ** 2
    tokens = patches + (tower == "clip") - (strategy == "default")
    text = {k: v for k, v in text_cfg.items() if k not in ("tie_word_embeddings", "torch_dtype")}
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text,
            "vision_config": vision, "image_token_index": image_token_id, "image_seq_length": tokens,
            "projector_hidden_act": "gelu", "vision_feature_layer": layer, "vision_feature_select_strategy": strategy,
            "multimodal_projector_bias": True, "tie_word_embeddings": text_cfg.get("tie_word_embeddings", False),
            "torch_dtype": text_cfg.get("torch_dtype", "bfloat16")}


def processor_config(cfg: dict) -> dict:
    """processor_config.json as LlavaProcessor.save_pretrained writes it (image processor nested)."""
    tower = "siglip" if cfg["vision_config"]["model_type"] == MODEL_TYPES["siglip"] else "clip"
    size = cfg["vision_config"]["image_size"]
    common = dict(do_convert_rgb=True, do_normalize=True, do_rescale=True, do_resize=True, resample=BICUBIC,
                  rescale_factor=1 / 255)
    if tower == "siglip":
        images = dict(common, image_processor_type="SiglipImageProcessor", size={"height": size, "width": size},
                      image_mean=list(STANDARD_MEAN), image_std=list(STANDARD_STD))
    else:
        images = dict(common, image_processor_type="CLIPImageProcessor", size={"shortest_edge": size},
                      do_center_crop=True, crop_size={"height": size, "width": size}, image_mean=list(CLIP_MEAN),
                      image_std=list(CLIP_STD))
    return {"image_processor": images, "image_token": "<image>", "num_additional_image_tokens": int(tower == "clip"),
            "patch_size": cfg["vision_config"]["patch_size"], "processor_class": "LlavaProcessor",
            "vision_feature_select_strategy": cfg["vision_feature_select_strategy"]}


def vision_tensors(cfg: dict, r) -> dict[str, np.ndarray]:
    """Tower (Hub names) and projector tensors drawn from ``r`` (common.tiny_model._Random)."""
    v = cfg["vision_config"]
    clip = v["model_type"] == MODEL_TYPES["clip"]
    d, inter, p, c = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["num_channels"]
    layers = v["num_hidden_layers"]
    branch = 1.0 / math.sqrt(2 * layers)  # each residual branch's share of the stream
    positions = (v["image_size"] // p) ** 2 + clip
    pre = "vision_tower.vision_model."
    w = {pre + "embeddings.patch_embedding.weight": r.normal((d, c, p, p), (c * p * p) ** -0.5),
         pre + "embeddings.position_embedding.weight": r.normal((positions, d), 0.5)}
    norms = ["post_layernorm"]
    if clip:
        w[pre + "embeddings.class_embedding"] = r.normal((d,), 1.0)
        norms.append("pre_layrnorm")
    else:
        w[pre + "embeddings.patch_embedding.bias"] = r.normal((d,), 0.1)
    for i in range(layers):
        norms += [f"encoder.layers.{i}.layer_norm1", f"encoder.layers.{i}.layer_norm2"]
        lp = pre + f"encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[lp + f"self_attn.{proj}.weight"] = r.normal((d, d), d ** -0.5 * (branch if proj == "out_proj" else 1.0))
            w[lp + f"self_attn.{proj}.bias"] = r.normal((d,), 0.1 * (branch if proj == "out_proj" else 1.0))
        w[lp + "mlp.fc1.weight"], w[lp + "mlp.fc1.bias"] = r.normal((inter, d), d ** -0.5), r.normal((inter,), 0.1)
        w[lp + "mlp.fc2.weight"] = r.normal((d, inter), inter ** -0.5 * branch)
        w[lp + "mlp.fc2.bias"] = r.normal((d,), 0.1 * branch)
    for norm in norms:
        w[pre + norm + ".weight"], w[pre + norm + ".bias"] = r.normal((d,), 0.1, 1.0), r.normal((d,), 0.1)
    text = cfg["text_config"]["hidden_size"]
    num_features = len(cfg["vision_feature_layer"]) if isinstance(cfg["vision_feature_layer"], list) else 1
    w.update({"multi_modal_projector.linear_1.weight": r.normal((text, d * num_features), (d * num_features) ** -0.5),
              "multi_modal_projector.linear_1.bias": r.normal((text,), 0.1),
              "multi_modal_projector.linear_2.weight": r.normal((text, text), text ** -0.5),
              "multi_modal_projector.linear_2.bias": r.normal((text,), 0.1)})
    return w


def llava_name(name: str) -> str:
    """A causal LM's tensor name in the Hub's LLaVA layout."""
    return "language_model." + name
