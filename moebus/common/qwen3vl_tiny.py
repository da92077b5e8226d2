"""``moebus init-model --arch qwen3_vl_moe``: a Qwen3-VL-MoE directory as Qwen's Hub checkpoints
are laid out: config.json in the Hub's spelling (``num_experts``, ``rope_scaling`` with the
interleaved ``mrope_section``), the language model under ``model.language_model.`` (fused experts
in the Hub's orientation), the tower, merger and DeepStack mergers under ``model.visual.``, ``lm_head.``; a tokenizer
with the vision tokens and a template that renders image parts as Qwen's does; a
``preprocessor_config.json`` for Qwen2VLImageProcessor. The language model is the Qwen3-MoE
preset's (same weights as ``--arch qwen3_moe``); the tower's weights are drawn from seed + 1."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moebus.common.image_processor import CLIP_MEAN, CLIP_STD
from moebus.common.qwen3vl_tokens import IMAGE_PAD, QWEN3VL_TEMPLATE, VIDEO_PAD, VISION_END, VISION_START, \
    VISION_TOKENS, vision_tokenizer
from moebus.common.tiny_tokenizer import SPECIAL_TOKENS

VISION_PRESETS = {
    # patches of 8 px merged 2 x 2; a 4 x 4 position table; DeepStack after LM layers 0 and 1
    "tiny": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=8, num_position_embeddings=16,
                 deepstack_visual_indexes=[0, 2]),
    "demo": dict(depth=4, hidden_size=192, intermediate_size=768, num_heads=3, patch_size=16,
                 num_position_embeddings=256, deepstack_visual_indexes=[1, 3]),
    # Qwen3-VL-30B-A3B's tower
    "a3b": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
}
PIXELS = {"tiny": (32 * 32, 128 * 128), "demo": (64 * 64, 512 * 512), "a3b": (65536, 16777216)}
MROPE = {16: [4, 2, 2], 32: [8, 4, 4], 128: [24, 20, 20]}  # head_dim -> mrope_section


def qwen3vl_config(text: dict, preset: str, token_ids: dict) -> dict:
    """config.json of Qwen3VLMoeForConditionalGeneration around a Qwen3-MoE preset's ``text``."""
    head_dim = text["head_dim"]
    if head_dim not in MROPE:
        raise ValueError(f"no mrope_section for head_dim {head_dim}")
    text = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype", "tie_word_embeddings",
                                                       "use_sliding_window", "sliding_window", "_preset")}
    text.update(model_type="qwen3_vl_moe_text", rope_scaling={"rope_type": "default", "mrope_interleaved": True,
                                                              "mrope_section": MROPE[head_dim]})
    vision = {**VISION_PRESETS.get(preset, VISION_PRESETS["tiny"]), "model_type": "qwen3_vl_moe",
              "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "out_hidden_size": text["hidden_size"]}
    if text["num_hidden_layers"] < len(vision["deepstack_visual_indexes"]):  # the loader refuses such a config
        raise ValueError(f"the {preset} tower adds {len(vision['deepstack_visual_indexes'])} DeepStack features "
                         f"after as many language model layers: --layers must be at least that")
    return {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False, **token_ids}


def preprocessor_config(cfg: dict, preset: str) -> dict:
    low, high = PIXELS.get(preset, PIXELS["tiny"])
    v = cfg["vision_config"]
    return {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
            "do_normalize": True, "do_convert_rgb": True, "resample": 3, "rescale_factor": 1 / 255,
            "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "patch_size": v["patch_size"],
            "temporal_patch_size": v["temporal_patch_size"], "merge_size": v["spatial_merge_size"],
            "size": {"shortest_edge": low, "longest_edge": high}}


def vision_tensors(cfg: dict, r) -> dict[str, np.ndarray]:
    """Random tower, merger and DeepStack merger weights (float32) under ``model.visual.``; residual
    branches scaled by 1 / sqrt(2 depth) so the hidden states keep unit size at any depth."""
    v = cfg["vision_config"]
    d, inter, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    merged, branch = d * v["spatial_merge_size"] ** 2, (2 * v["depth"]) ** -0.5
    patch_dim = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    w = {"patch_embed.proj.weight": r.normal((d, v["in_channels"], v["temporal_patch_size"], v["patch_size"],
                                              v["patch_size"]), patch_dim ** -0.5),
         "patch_embed.proj.bias": r.normal((d,), 0.1), "pos_embed.weight": r.normal((v["num_position_embeddings"], d), 0.5)}
    for i in range(v["depth"]):
        p = f"blocks.{i}."
        for norm in ("norm1", "norm2"):
            w.update({p + norm + ".weight": r.normal((d,), 0.1, 1.0), p + norm + ".bias": r.normal((d,), 0.1)})
        w.update({p + "attn.qkv.weight": r.normal((3 * d, d), d ** -0.5), p + "attn.qkv.bias": r.normal((3 * d,), 0.1),
                  p + "attn.proj.weight": r.normal((d, d), branch * d ** -0.5), p + "attn.proj.bias": r.normal((d,), 0.1),
                  p + "mlp.linear_fc1.weight": r.normal((inter, d), d ** -0.5),
                  p + "mlp.linear_fc1.bias": r.normal((inter,), 0.1),
                  p + "mlp.linear_fc2.weight": r.normal((d, inter), branch * inter ** -0.5),
                  p + "mlp.linear_fc2.bias": r.normal((d,), 0.1)})
    mergers = ["merger."] + [f"deepstack_merger_list.{j}." for j in range(len(v["deepstack_visual_indexes"]))]
    for p in mergers:
        norm = d if p == "merger." else merged
        w.update({p + "norm.weight": r.normal((norm,), 0.1, 1.0), p + "norm.bias": r.normal((norm,), 0.1),
                  p + "linear_fc1.weight": r.normal((merged, merged), merged ** -0.5),
                  p + "linear_fc1.bias": r.normal((merged,), 0.1),
                  p + "linear_fc2.weight": r.normal((out, merged), 0.5 * merged ** -0.5),
                  p + "linear_fc2.bias": r.normal((out,), 0.1)})
    return {"model.visual." + name: array for name, array in w.items()}


def fuse_experts(layer: int, tensors: dict, num_experts: int) -> dict:
    """A layer's per-expert tensors as the Hub's fused ones: ``experts.gate_up_proj`` (E, D, 2I) and
    ``experts.down_proj`` (E, I, D) (what transformers' Qwen3VLMoe loader reads)."""
    prefix = f"model.layers.{layer}.mlp.experts."
    if prefix + "0.gate_proj.weight" not in tensors:
        return tensors  # a dense layer
    pop = lambda e, n: tensors.pop(f"{prefix}{e}.{n}.weight")  # noqa: E731
    gate_up = [np.concatenate([pop(e, "gate_proj"), pop(e, "up_proj")]).T for e in range(num_experts)]
    down = [pop(e, "down_proj").T for e in range(num_experts)]
    tensors[prefix + "gate_up_proj"] = np.ascontiguousarray(np.stack(gate_up))
    tensors[prefix + "down_proj"] = np.ascontiguousarray(np.stack(down))
    return tensors


def qwen3vl_name(name: str) -> str:
    """A causal LM's tensor name in Qwen3-VL's layout (``model.`` -> ``model.language_model.``)."""
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def write_qwen3vl_files(out: Path, cfg: dict, preset: str, tokenizer, eos: int) -> None:
    """Everything but the weights: config, tokenizer, template, processor and generation configs."""
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(cfg, preset), indent=2))
    (out / "chat_template.jinja").write_text(QWEN3VL_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN3VL_TEMPLATE, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": SPECIAL_TOKENS[1:] + VISION_TOKENS,
        "model_max_length": cfg["text_config"]["max_position_embeddings"]}, indent=2))
    pad = tokenizer.token_to_id("<|endoftext|>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, pad], "pad_token_id": pad,
                                                            "do_sample": False}, indent=2))


def token_ids(tokenizer) -> dict:
    return {key: tokenizer.token_to_id(tok) for key, tok in (("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD),
                                                              ("vision_start_token_id", VISION_START),
                                                              ("vision_end_token_id", VISION_END))}


def init_qwen3vl(out: Path, text: dict, preset: str, dtype: str, progress, write_weights, text_random,
                 vision_random) -> Path:
    """The directory for tiny_model.init_model around the Qwen3-MoE preset's config ``text``
    (``write_weights``: its _write_weights; the two random sources: its _Random)."""
    tokenizer = vision_tokenizer(min(text["vocab_size"] - 64, 4096), seed=0)
    eos = tokenizer.token_to_id("<|im_end|>")
    text = {**text, "eos_token_id": eos}
    cfg = qwen3vl_config(text, preset, token_ids(tokenizer))
    cfg["torch_dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    write_weights(out, {**text, "_preset": preset}, "qwen3_moe", text_random, dtype, progress, rename=qwen3vl_name,
                  extra=lambda: vision_tensors(cfg, vision_random),
                  adjust_layer=lambda i, tensors: fuse_experts(i, tensors, text["num_experts"]))
    write_qwen3vl_files(out, cfg, preset, tokenizer, eos)
    return out
