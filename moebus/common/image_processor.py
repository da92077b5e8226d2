"""Image preprocessing as transformers' SigLIP and CLIP image processors do it (their PIL backend),
with Pillow and numpy: convert to RGB over white, resize, center crop, rescale, normalize. The
settings come from the checkpoint's own files: ``processor_config.json`` (current transformers nests
them under ``image_processor``) or ``preprocessor_config.json`` (Hub checkpoints)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

from moebus.common.errors import CheckpointError

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
STANDARD_MEAN, STANDARD_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
BICUBIC = 3
# class defaults of SiglipImageProcessor and CLIPImageProcessor, for keys a config omits
DEFAULTS = {
    "siglip": dict(do_resize=True, size={"height": 224, "width": 224}, resample=BICUBIC, do_center_crop=False,
                   do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=STANDARD_MEAN,
                   image_std=STANDARD_STD, do_convert_rgb=True),
    "clip": dict(do_resize=True, size={"shortest_edge": 224}, resample=BICUBIC, do_center_crop=True,
                 crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                 image_mean=CLIP_MEAN, image_std=CLIP_STD, do_convert_rgb=True),
}


def _kind(type_name: str | None, where: str) -> str:
    name = (type_name or "").removesuffix("Fast").removesuffix("Pil")
    kinds = {"SiglipImageProcessor": "siglip", "CLIPImageProcessor": "clip"}
    if name not in kinds:
        raise CheckpointError(f"{where}: image processor {type_name!r} is not supported (supported: {sorted(kinds)})")
    return kinds[name]


def _size_dict(size, square: bool) -> dict:
    """transformers' get_size_dict: an int is a shortest edge (size) or a square (crop_size)."""
    if isinstance(size, int):
        return {"height": size, "width": size} if square else {"shortest_edge": size}
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return {"height": int(size[0]), "width": int(size[1])}
    return dict(size)


def _read_settings(model_dir: Path) -> tuple[dict, dict, str]:
    """(image processor settings, processor settings, the file they came from)."""
    nested, processor = model_dir / "processor_config.json", {}
    if nested.is_file():
        processor = _read_json(nested)
        if isinstance(processor.get("image_processor"), dict):
            return processor["image_processor"], processor, str(nested)
    flat = model_dir / "preprocessor_config.json"
    if flat.is_file():
        return _read_json(flat), processor, str(flat)
    raise CheckpointError(f"{model_dir}: neither processor_config.json (with image_processor) nor "
                          "preprocessor_config.json: the model has no image processor")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e


class ImageProcessor:
    """One image in, ``(C, H, W)`` float32 pixel values out, equal to transformers' processor."""

    def __init__(self, settings: dict, where: str = "processor config", processor: dict | None = None):
        self.kind = _kind(settings.get("image_processor_type"), where)
        s = {**DEFAULTS[self.kind], **{k: v for k, v in settings.items() if v is not None}}
        self.do_resize, self.do_center_crop = bool(s["do_resize"]), bool(s["do_center_crop"])
        self.do_rescale, self.do_normalize = bool(s["do_rescale"]), bool(s["do_normalize"])
        self.do_convert_rgb = bool(s["do_convert_rgb"])
        self.size = _size_dict(s["size"], square=False)
        self.crop_size = _size_dict(s.get("crop_size") or {"height": 224, "width": 224}, square=True)
        self.resample = int(s["resample"])
        self.rescale_factor = float(s["rescale_factor"])
        self.mean = np.array(s["image_mean"], np.float32)
        self.std = np.array(s["image_std"], np.float32)
        if self.do_resize and not ({"height", "width"} <= set(self.size) or set(self.size) == {"shortest_edge"}):
            raise CheckpointError(f"{where}: image size {self.size} is not supported "
                                  "(height and width, or shortest_edge)")
        processor = processor or {}
        self.num_additional_image_tokens = int(processor.get("num_additional_image_tokens") or 0)
        self.patch_size = processor.get("patch_size")
        self.select_strategy = processor.get("vision_feature_select_strategy")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ImageProcessor":
        settings, processor, where = _read_settings(Path(model_dir))
        return cls(settings, where, processor)

    @property
    def image_size(self) -> tuple[int, int] | None:
        """(H, W) of every output; None when it follows the input (shortest-edge resize, no crop)."""
        if self.do_center_crop:
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "height" in self.size:
            return self.size["height"], self.size["width"]
        return None

    def tokens_per_image(self, patch_size: int, select_strategy: str) -> int:
        """The placeholder count as LlavaProcessor computes it from the output size."""
        height, width = self.image_size or (0, 0)
        count = (height // patch_size) * (width // patch_size) + self.num_additional_image_tokens
        return count - (1 if select_strategy == "default" else 0)

    def check_matches(self, cfg) -> None:
        """Raise CheckpointError unless this processor's output fits the tower of ``cfg`` (a
        VisionConfig): its image size, and LlavaProcessor's token count where the processor config
        gives one (patch_size), equal to the features the tower yields."""
        expected = (cfg.image_size, cfg.image_size)
        if self.image_size != expected:
            raise CheckpointError(f"image processor makes {self.image_size or 'variable-size'} images, "
                                  f"the vision tower takes {expected}")
        if self.patch_size is not None:
            tokens = self.tokens_per_image(int(self.patch_size), self.select_strategy or cfg.select_strategy)
            if tokens != cfg.num_image_tokens:
                raise CheckpointError(f"processor config expands an image to {tokens} tokens, the vision tower "
                                      f"gives {cfg.num_image_tokens} features (num_additional_image_tokens?)")

    def preprocess(self, image: Image.Image) -> np.ndarray:
        pixels = self._channels_last(image)
        if self.do_resize:
            pixels = self._resize(pixels)
        pixels = np.moveaxis(pixels, -1, 0)  # (C, H, W) from here on
        if self.do_center_crop:
            pixels = center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32, copy=False)
        if self.do_normalize:
            if pixels.shape[0] != len(self.mean):
                raise ValueError(f"image has {pixels.shape[0]} channels, the processor normalizes {len(self.mean)}")
            pixels = (pixels - self.mean[:, None, None]) / self.std[:, None, None]
        return np.ascontiguousarray(pixels, dtype=np.float32)

    def _channels_last(self, image: Image.Image) -> np.ndarray:
        if self.do_convert_rgb:
            image = to_rgb(image)
        pixels = np.array(image)
        return pixels[..., None] if pixels.ndim == 2 else pixels

    def _resize(self, pixels: np.ndarray) -> np.ndarray:
        height, width = pixels.shape[:2]
        if "shortest_edge" in self.size:
            new_h, new_w = shortest_edge_size(height, width, int(self.size["shortest_edge"]))
        else:
            new_h, new_w = int(self.size["height"]), int(self.size["width"])
        image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
        resized = np.array(image.resize((new_w, new_h), resample=self.resample))
        return resized[..., None] if resized.ndim == 2 else resized


def load_image_processor(model_dir: str | Path):
    """The checkpoint's image processor: an ImageProcessor (SigLIP, CLIP) or, for Qwen2VL's kind,
    a Qwen3VLImageProcessor (common/qwen3vl_image_processor.py)."""
    from moebus.common.qwen3vl_image_processor import KINDS, Qwen3VLImageProcessor

    settings, processor, where = _read_settings(Path(model_dir))
    if settings.get("image_processor_type") in KINDS:
        return Qwen3VLImageProcessor(settings, where)
    return ImageProcessor(settings, where, processor)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, compositing any transparency onto white (what transformers' convert_to_rgb does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """(H, W) with the shorter side = edge and the longer one scaled and truncated, as transformers."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """(C, h, w) -> (C, height, width) around the center; a smaller image is zero-padded first."""
    h, w = pixels.shape[-2:]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[..., top : top + height, left : left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros(pixels.shape[:-2] + (new_h, new_w), dtype=pixels.dtype)
    pad_top, pad_left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[..., pad_top : pad_top + h, pad_left : pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[..., max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)]


def expand_image_tokens(ids: list[int], image_token_id: int, num_image_tokens: int) -> list[int]:
    """Each image placeholder token becomes ``num_image_tokens`` of them, as LlavaProcessor expands
    its ``<image>`` placeholder before tokenizing."""
    out: list[int] = []
    for token in ids:
        out.extend([token] * num_image_tokens if token == image_token_id else (token,))
    return out
