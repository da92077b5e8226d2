"""Tiny LLaVA models for tests: built by transformers and saved with ``save_pretrained`` (model and
``LlavaProcessor``), rewritten into the other checkpoint layouts, and test images."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from moebus.common.safetensors_io import SafetensorsFile, save_file
from moebus.common.tiny_tokenizer import CHATML_TEMPLATE, IMAGE_TOKEN, SPECIAL_TOKENS, train_tokenizer
from tests.models import HF_SHAPES

# 32 px images of 8 px patches: 16 patches (CLIP: 17 positions)
VISION_SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     image_size=32, patch_size=8)


def llava_tokenizer():
    """The tiny tokenizer with ``<image>``, as a transformers fast tokenizer with the ChatML template."""
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(HF_SHAPES["vocab_size"] - 64, image_token=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:] + [IMAGE_TOKEN],
                                   chat_template=CHATML_TEMPLATE)


def _text_config(arch: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**HF_SHAPES, head_dim=16, num_experts=8, moe_intermediate_size=32,
                              intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1])
    return MixtralConfig(**HF_SHAPES, num_local_experts=6, intermediate_size=32)


def _scale_weights(model) -> None:
    """Unit-sized activations and clear logit margins (greedy continuations must not hinge on rounding)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            vision = "vision_tower" in name or "multi_modal_projector" in name
            if "norm" in name and not (vision and name.endswith("bias")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif vision and (name.endswith("bias") or "class_embedding" in name):
                p.copy_(0.1 * torch.randn_like(p) if name.endswith("bias") else torch.randn_like(p))
            elif vision and "position_embedding" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif vision:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
            else:
                fan_in = p.shape[-1]
                scale = 4.0 if "lm_head" in name else 2.0 if ("gate.weight" in name and "proj" not in name) else 1.0
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else scale / fan_in ** 0.5))


def make_hf_llava(out_dir: Path, tower: str = "siglip", text_arch: str = "qwen3_moe", feature_layer=-2,
                  strategy: str = "default", projector_bias: bool = True, projector_act: str = "gelu",
                  dtype: str = "f32", seed: int = 0, image_size: int | None = None) -> Path:
    """A LlavaForConditionalGeneration built from a config, saved by save_pretrained together with
    a LlavaProcessor (tokenizer with ``<image>``, the tower's image processor, ChatML template).
    ``image_size``: another side than VISION_SHAPES' (one the patch does not divide, as SigLIP-so400m's
    384 px in patches of 14)."""
    import torch
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor, SiglipImageProcessorPil, SiglipVisionConfig)

    torch.manual_seed(seed)
    tokenizer = llava_tokenizer()
    is_clip = tower == "clip"
    shapes = {**VISION_SHAPES, **({"image_size": image_size} if image_size else {})}
    vision = (CLIPVisionConfig if is_clip else SiglipVisionConfig)(**shapes)
    size = shapes["image_size"]
    tokens = (size // VISION_SHAPES["patch_size"]) ** 2 + is_clip - (strategy == "default")
    cfg = LlavaConfig(vision_config=vision, text_config=_text_config(text_arch),
                      image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), image_seq_length=tokens,
                      vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                      projector_hidden_act=projector_act, multimodal_projector_bias=projector_bias)
    model = LlavaForConditionalGeneration(cfg)
    _scale_weights(model)
    if dtype in ("bf16", "f16"):
        model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    model.save_pretrained(out_dir)
    images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}) \
        if is_clip else SiglipImageProcessorPil(size={"height": size, "width": size})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=VISION_SHAPES["patch_size"],
                               vision_feature_select_strategy=strategy, num_additional_image_tokens=int(is_clip),
                               chat_template=CHATML_TEMPLATE)
    processor.save_pretrained(out_dir)
    return Path(out_dir)


def _rename(src: Path, dst: Path, rename) -> Path:
    """A copy of a model directory with every tensor name mapped through ``rename``."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            (dst / f.name).write_bytes(f.read_bytes())
    st = SafetensorsFile(src / "model.safetensors")
    save_file({rename(n): (np.array(st.array(n)), st.dtype_name(n)) for n in st.keys()}, dst / "model.safetensors")
    return dst


def hub_layout(src: Path, dst: Path) -> Path:
    """save_pretrained's ``vision_tower.*`` as the Hub writes it: ``vision_tower.vision_model.*``."""
    return _rename(src, dst, lambda n: n.replace("vision_tower.", "vision_tower.vision_model.", 1))


def in_memory_layout(model, dst: Path) -> Path:
    """The model's own state_dict names (``model.vision_tower.*``, fused experts), one shard per half."""
    dst.mkdir(parents=True)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: (np.ascontiguousarray(state[n]), "F32") for n in part}, dst / fname)
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.save_pretrained(dst)
    return dst


@functools.cache
def reference_composites_alpha() -> bool:
    """Whether transformers' image processors composite a transparent image onto white, as moebus
    does (common/image_processor.to_rgb). transformers 5.21 made convert_to_rgb do so; before it,
    ``image.convert("RGB")`` dropped the alpha channel (RGBA) or the transparency (palette), so the
    pixels of such images differ by design, not by a fault of either side."""
    from PIL import Image
    from transformers import SiglipImageProcessorPil

    clear = Image.new("RGBA", (1, 1), (0, 0, 0, 0))
    plain = SiglipImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False)
    return float(plain(images=[clear], return_tensors="np")["pixel_values"].min()) == 255.0


def over_white(image):
    """``image`` composited onto white, as transformers >= 5.21 and moebus read a transparent image:
    what an older reference is given so that both sides see the same RGB pixels."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def sample_images(seed: int = 0):
    """Odd-sized RGB, RGBA and grayscale PIL images."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (45, 37, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (29, 51, 4), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (33, 33), dtype=np.uint8))]
