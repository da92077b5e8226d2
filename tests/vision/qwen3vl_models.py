"""Tiny Qwen3-VL-MoE models for tests, built by transformers and saved with ``save_pretrained``
(model, Qwen3VLProcessor with the PIL image processor, tokenizer), rewritten into the Hub's layout
(fused experts transposed, config keys in the Hub's spelling), and test images of several sizes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moebus.common.qwen3vl_tokens import IMAGE_PAD, QWEN3VL_TEMPLATE, VISION_TOKENS, vision_tokenizer
from moebus.common.safetensors_io import SafetensorsFile, save_file
from moebus.common.tiny_tokenizer import SPECIAL_TOKENS

# D = 64 and I = 24: the fused experts' orientation is told by shape (2I != D, I != D)
TEXT = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=96,
            max_position_embeddings=1024, mlp_only_layers=[1], tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
# patches of 8 px merged 2 x 2: an image becomes (h / 16) (w / 16) tokens; a 4 x 4 position table
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=8, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
PIXELS = dict(shortest_edge=32 * 32, longest_edge=64 * 64)


def qwen3vl_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = vision_tokenizer(TEXT["vocab_size"] - 64)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:] + VISION_TOKENS,
                                   chat_template=QWEN3VL_TEMPLATE)


def _scale_weights(model) -> None:
    """Unit-sized activations and clear logit margins (greedy continuations must not hinge on rounding)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            vision = ".visual." in name or name.startswith("visual.")
            if "norm" in name and name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif vision and name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif vision and "pos_embed" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif vision:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
            else:
                fan_in = p.shape[-1]
                scale = 4.0 if "lm_head" in name else 2.0 if name.endswith("mlp.gate.weight") else 1.0
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else scale / fan_in ** 0.5))


def make_hf_qwen3vl(out_dir: Path, dtype: str = "f32", seed: int = 0, vision: dict | None = None) -> Path:
    """A Qwen3VLMoeForConditionalGeneration built from a config, saved by save_pretrained with its
    tokenizer (the vision tokens, the template) and Qwen2VLImageProcessorPil."""
    import torch
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = qwen3vl_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("image_token_id", IMAGE_PAD), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    cfg = Qwen3VLMoeConfig(text_config=dict(TEXT), vision_config={**VISION, **(vision or {})}, **ids)
    model = Qwen3VLMoeForConditionalGeneration(cfg)
    _scale_weights(model)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    images = Qwen2VLImageProcessorPil(size=dict(PIXELS), patch_size=VISION["patch_size"], temporal_patch_size=2,
                                      merge_size=VISION["spatial_merge_size"])
    # Qwen3VLProcessor itself needs its video processor (torchvision): the image processor and the
    # tokenizer are saved on their own, and the tests expand <|image_pad|> as replace_image_token does
    images.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


def hub_layout(src: Path, dst: Path) -> Path:
    """The same model as Qwen's Hub checkpoints store it: fused experts (E, D, 2I) and (E, I, D),
    config keys ``num_experts``, ``rope_scaling`` + ``rope_theta``, the processor's ``min_pixels`` /
    ``max_pixels``; two shards and an index."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
            (dst / f.name).write_bytes(f.read_bytes())
    st = SafetensorsFile(src / "model.safetensors")
    tensors = {}
    for n in st.keys():
        a = np.array(st.array(n))
        tensors[n] = (np.ascontiguousarray(a.transpose(0, 2, 1)) if n.endswith(("gate_up_proj", "down_proj"))
                      and a.ndim == 3 else a, st.dtype_name(n))
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, dst / fname)
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    text = cfg["text_config"]
    text["num_experts"] = text.pop("num_local_experts")
    params = text.pop("rope_parameters")
    text["rope_theta"] = params.pop("rope_theta")
    text["rope_scaling"] = params
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    _hub_preprocessor(dst)
    return dst


def _hub_preprocessor(dst: Path) -> None:
    """min_pixels / max_pixels at the top of preprocessor_config.json, as Qwen's Hub files have them."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = dst / name
        if not path.is_file():
            continue
        raw = json.loads(path.read_text())
        settings = raw.get("image_processor", raw)
        size = settings.pop("size", {})
        settings.update(min_pixels=size.get("shortest_edge"), max_pixels=size.get("longest_edge"))
        path.write_text(json.dumps(raw, indent=2))


def sample_images(seed: int = 0):
    """RGB images of different sizes and aspect ratios."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (45, 37, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (40, 70, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (90, 50, 3), dtype=np.uint8))]


def per_expert_layout(src: Path, dst: Path) -> Path:
    """The same model with one tensor per expert (``experts.{e}.gate_proj.weight`` ...), as older
    exports and FP8 checkpoints keep them."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            (dst / f.name).write_bytes(f.read_bytes())
    st = SafetensorsFile(src / "model.safetensors")
    tensors = {}
    for n in st.keys():
        a, kind = np.array(st.array(n)), st.dtype_name(n)
        if n.endswith("experts.gate_up_proj"):  # (E, 2I, D)
            inter = a.shape[1] // 2
            for e in range(a.shape[0]):
                tensors[n[: -len("gate_up_proj")] + f"{e}.gate_proj.weight"] = (np.ascontiguousarray(a[e, :inter]), kind)
                tensors[n[: -len("gate_up_proj")] + f"{e}.up_proj.weight"] = (np.ascontiguousarray(a[e, inter:]), kind)
        elif n.endswith("experts.down_proj"):  # (E, D, I)
            for e in range(a.shape[0]):
                tensors[n[: -len("down_proj")] + f"{e}.down_proj.weight"] = (np.ascontiguousarray(a[e]), kind)
        else:
            tensors[n] = (a, kind)
    save_file(tensors, dst / "model.safetensors")
    return dst
