"""Qwen3-VL's image preprocessing as transformers' ``Qwen2VLImageProcessor`` does it (its PIL
backend), with Pillow and numpy: RGB over white, the *smart resize* (both sides multiples of
patch_size x merge_size, the pixel count within [min_pixels, max_pixels], the aspect ratio kept as
closely as that allows), rescale, normalize, then the flattened patches in the order the tower
takes them (merge windows of merge_size x merge_size patches together; a still image is repeated
over the temporal_patch_size frames). The settings come from ``preprocessor_config.json`` (or a
``processor_config.json`` with a nested ``image_processor``): ``size.shortest_edge`` /
``size.longest_edge`` (pixel counts, current transformers) or ``min_pixels`` / ``max_pixels`` (Qwen's
Hub files); keys a file omits take the class defaults.

The vision worker sends the tower the resized image's bytes and each byte value's rescaled and
normalized float per channel (``byte_values``: the same numpy operations on the 256 values); the
tower patchifies on the device (cuda/kernels/patchify.py), equal to ``patches`` here bit for bit."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image

from moebus.common.errors import CheckpointError, RequestError
from moebus.common.image_processor import CLIP_MEAN, CLIP_STD, _read_settings, to_rgb

KINDS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
DEFAULTS = dict(do_resize=True, resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                image_mean=CLIP_MEAN, image_std=CLIP_STD, do_convert_rgb=True, patch_size=14, temporal_patch_size=2,
                merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
MAX_ASPECT_RATIO = 200  # smart_resize refuses more
BYTE_VALUES = 256


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize (qwen2_vl): (H, W) multiples of ``factor`` within the pixel bounds."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise RequestError(f"a {width}x{height} image: the aspect ratio must be under {MAX_ASPECT_RATIO}",
                           code="invalid_image")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class ImagePatches:
    """One image, ready for the tower: (grid_h * grid_w, C * T * p * p) float32 ``patches``. Where the
    resized image is bytes (the usual case) it keeps them instead, ``pixels`` (H, W, C) uint8 and
    ``values`` (C, 256) float32 (each byte's rescaled and normalized value per channel), and the
    tower makes the patches on the device (cuda/kernels/patchify.py); ``patches`` is then made on the
    host only when read (the same values bit for bit)."""

    def __init__(self, patches: np.ndarray | None, grid_h: int, grid_w: int, pixels: np.ndarray | None = None,
                 values: np.ndarray | None = None, sizes: tuple[int, int, int] | None = None):
        """``sizes``: (patch, merge, temporal) of ``pixels``."""
        if patches is None and (pixels is None or values is None or sizes is None):
            raise ValueError("an image needs its patches, or its pixels, their values and sizes")
        self._patches, self.grid_h, self.grid_w = patches, grid_h, grid_w
        self.pixels, self.values, self.sizes = pixels, values, sizes

    @property
    def patches(self) -> np.ndarray:
        if self._patches is None:
            from moebus.cuda.kernels.patchify import pixel_patches_ref  # (numba.cuda: not at the broker's import)

            self._patches = pixel_patches_ref(self.pixels, self.values, *self.sizes)
        return self._patches


class Qwen3VLImageProcessor:
    def __init__(self, settings: dict, where: str = "preprocessor config"):
        kind = settings.get("image_processor_type")
        if kind not in KINDS:
            raise CheckpointError(f"{where}: image processor {kind!r} is not supported here (expected one of {KINDS})")
        s = {**DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
        size = s.get("size") or {}
        self.min_pixels = int(size.get("shortest_edge") or s["min_pixels"])
        self.max_pixels = int(size.get("longest_edge") or s["max_pixels"])
        self.do_resize, self.do_rescale = bool(s["do_resize"]), bool(s["do_rescale"])
        self.do_normalize, self.do_convert_rgb = bool(s["do_normalize"]), bool(s["do_convert_rgb"])
        self.resample, self.rescale_factor = int(s["resample"]), float(s["rescale_factor"])
        self.mean, self.std = np.array(s["image_mean"], np.float32), np.array(s["image_std"], np.float32)
        self.patch_size, self.merge_size = int(s["patch_size"]), int(s["merge_size"])
        self.temporal_patch_size = int(s["temporal_patch_size"])
        self._values: dict[int, np.ndarray] = {}  # byte_values per channel count

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Qwen3VLImageProcessor":
        settings, _, where = _read_settings(Path(model_dir))
        return cls(settings, where)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(grid_h, grid_w) in patches of an image of this size (from its header: nothing decoded)."""
        if self.do_resize:
            height, width = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return height // self.patch_size, width // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        grid_h, grid_w = self.grid(width, height)
        return grid_h * grid_w // self.merge_size ** 2

    def check_matches(self, cfg) -> None:
        """Raise CheckpointError unless the patches fit the tower of ``cfg`` (Qwen3VisionConfig)."""
        mine = (self.patch_size, self.temporal_patch_size, self.merge_size)
        tower = (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)
        if mine != tower:
            raise CheckpointError(f"the image processor's patch, temporal patch and merge sizes {mine} differ from "
                                  f"the vision tower's {tower}")

    def preprocess(self, image: Image.Image) -> ImagePatches:
        """The image resized; its bytes and their values (the tower patchifies on the device), or
        where they are not bytes (or their values not one per channel), its float32 patches."""
        pixels = self.resized(image)
        values = self.byte_values(pixels)
        if values is not None:
            grid_h, grid_w = (side // self.patch_size for side in pixels.shape[:2])
            return ImagePatches(None, grid_h, grid_w, pixels=pixels, values=values,
                                sizes=(self.patch_size, self.merge_size, self.temporal_patch_size))
        pixels = np.moveaxis(self.rescaled_normalized(pixels), -1, 0)  # (C, H, W)
        return patchify(pixels.astype(np.float32, copy=False), self.patch_size, self.merge_size,
                        self.temporal_patch_size)

    def resized(self, image: Image.Image) -> np.ndarray:
        """(H, W, C) pixels, RGB, smart-resized (Pillow's resample, as transformers' PIL backend). An RGB
        or grey image is resized as it is and read into numpy once (not at its size: Pillow's resize to
        the same size is a copy); other modes go through numpy first, as transformers' processor does."""
        image = to_rgb(image) if self.do_convert_rgb else image
        if image.mode in ("RGB", "L"):
            if self.do_resize:
                new_h, new_w = smart_resize(image.height, image.width, self.factor, self.min_pixels, self.max_pixels)
                if (new_w, new_h) != image.size:
                    image = image.resize((new_w, new_h), resample=self.resample)
            pixels = np.asarray(image)
            return pixels[..., None] if pixels.ndim == 2 else pixels
        pixels = np.array(image)
        pixels = pixels[..., None] if pixels.ndim == 2 else pixels
        if self.do_resize:
            height, width = pixels.shape[:2]
            new_h, new_w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
            resized = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
            pixels = np.array(resized.resize((new_w, new_h), resample=self.resample))
            pixels = pixels[..., None] if pixels.ndim == 2 else pixels
        return pixels

    def rescaled_normalized(self, pixels: np.ndarray) -> np.ndarray:
        """(H, W, C) pixels -> float32, rescaled and normalized as transformers does."""
        # the arithmetic on the (H, W, C) pixels as decoded, element by element the same operations as
        # transformers' (the same values), ~8x faster than on the (C, H, W) view: patchify reads that view
        if self.do_rescale:  # the product in float64, rounded to float32 (as .astype(np.float32) rounds)
            scaled = np.empty(pixels.shape, np.float32)
            np.multiply(pixels, np.float64(self.rescale_factor), out=scaled, dtype=np.float64, casting="unsafe")
            pixels = scaled
        pixels = pixels.astype(np.float32, copy=False)
        if self.do_normalize:
            pixels = normalize_rows(pixels, self.mean, self.std)
        return pixels

    def byte_values(self, pixels: np.ndarray) -> np.ndarray | None:
        """(C, 256) float32: rescaled_normalized of every byte value per channel (elementwise, so a
        byte's value is the one it would have in any image), or None where ``pixels`` are not bytes
        sized for the tower (sides multiples of the factor) or the settings mix channels."""
        channels = pixels.shape[-1]
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or not self.do_resize:
            return None
        if self.do_normalize and (self.mean.shape != (channels,) or self.std.shape != (channels,)):
            return None
        if channels not in self._values:
            ramp = np.repeat(np.arange(BYTE_VALUES, dtype=np.uint8)[None, :, None], channels, axis=2)
            self._values[channels] = np.ascontiguousarray(self.rescaled_normalized(ramp)[0].T, dtype=np.float32)
        return self._values[channels]


def normalize_rows(pixels: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """(x - mean) / std per channel of (H, W, C) float32 pixels, computed over rows of W * C values
    (numpy's inner loop over a length-C axis is ~10x slower); the same operations per element."""
    height, width, channels = pixels.shape
    if mean.shape != (channels,):  # (a grey image without do_convert_rgb: broadcast as before)
        if channels != 1:
            raise ValueError(f"image has {channels} channels, the processor normalizes {mean.shape[0]} "
                             f"(do_convert_rgb is off: send an RGB or greyscale image)")
        return (pixels - mean) / std
    rows = pixels.reshape(height, width * channels)
    out = np.subtract(rows, np.tile(mean, width))
    np.divide(out, np.tile(std, width), out=out)
    return out.reshape(height, width, channels)


def patchify(image: np.ndarray, patch: int, merge: int, temporal: int) -> ImagePatches:
    """(C, H, W) -> patches in merge-window order, each (C, T, p, p) flattened (Qwen2VL's patchify)."""
    channels, height, width = image.shape
    grid_h, grid_w = height // patch, width // patch
    x = image.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    x = np.transpose(x, (1, 4, 2, 5, 0, 3, 6))  # (gh, gw, mh, mw, C, ph, pw)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (temporal,) + x.shape[5:])
    flat = np.ascontiguousarray(x.reshape(grid_h * grid_w, channels * temporal * patch * patch), dtype=np.float32)
    return ImagePatches(flat, grid_h, grid_w)
