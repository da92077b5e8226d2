"""Qwen3-VL's patches made on the device from the resized image's bytes: the host sends the
(H, W, C) uint8 pixels (2.4 MB for 1024 x 768) instead of the float32 patches (19 MB), and this
kernel looks every byte up in ``values`` (C, 256) float32 — the processor's rescale and normalize of
each byte value per channel, computed on the host by the processor's own numpy operations
(common/qwen3vl_image_processor.py ``byte_values``) — and writes it where Qwen2VL's patchify puts it:
patches in merge-window order, each (C, T, p, p) flattened, a still image repeated over the T
temporal frames. A lookup rounds nothing, so the patches equal the host processor's bit for bit."""
from __future__ import annotations

import functools
import os

import numpy as np

from moebus.cuda.kernels.compat import blocks, cuda, kernel, threads
from moebus.cuda.kernels.launch import require

BYTE_VALUES = 256  # (qwen3vl_image_processor.BYTE_VALUES)
# 1: a thread per pixel of a patch (pixel_patches_by_frame: its place found once, each byte looked up once,
# written to each channel's T frames); 0: a thread per output value (four divisions each). The same values
# either way; opt-in: on the H200 neither showed in the a3b tower's time (under 0.14 ms; fifteenth session)
BY_FRAME = os.environ.get("MOEBUS_PATCHIFY_BY_FRAME", "0") == "1"


def patches_shape(pixels_shape, patch: int, temporal: int) -> tuple[int, int]:
    """(patches, C * T * p * p) of an (H, W, C) image."""
    height, width, channels = pixels_shape
    return (height // patch) * (width // patch), channels * temporal * patch * patch


def pixel_patches_ref(pixels: np.ndarray, values: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """(H, W, C) uint8 pixels, (C, 256) float32 values -> (grid_h * grid_w, C * T * p * p) float32:
    ``values[c, pixels[y, x, c]]`` in Qwen2VL's patch order (H and W multiples of p * merge)."""
    height, width, channels = pixels.shape
    grid_h, grid_w = height // patch, width // patch
    looked = np.asarray(values, np.float32)[np.arange(channels), pixels]  # (H, W, C)
    x = np.moveaxis(looked, -1, 0).reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    x = np.transpose(x, (1, 4, 2, 5, 0, 3, 6))  # (gh, gw, mh, mw, C, ph, pw)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (temporal,) + x.shape[5:])
    return np.ascontiguousarray(x.reshape(grid_h * grid_w, channels * temporal * patch * patch), dtype=np.float32)


# -- cuda -----------------------------------------------------------------------------------------

@functools.cache
def _pixel_patches_kernel():
    @kernel
    def pixel_patches(pixels, values, out, patch, merge):
        # one block per patch (grid-stride), threads along its (C, T, p, p) values: the writes are
        # contiguous, the reads p bytes of a pixel row at a time
        num_patches, dim = out.shape
        channels = pixels.shape[2]
        per_channel = dim // channels  # T * p * p
        per_frame = patch * patch
        windows_w = pixels.shape[1] // (patch * merge)
        for n in range(cuda.blockIdx.x, num_patches, cuda.gridDim.x):
            window, inner = n // (merge * merge), n % (merge * merge)
            y0 = ((window // windows_w) * merge + inner // merge) * patch
            x0 = ((window % windows_w) * merge + inner % merge) * patch
            for j in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
                c, r = j // per_channel, j % per_frame
                out[n, j] = values[c, pixels[y0 + r // patch, x0 + r % patch, c]]

    return pixel_patches


@functools.cache
def _pixel_patches_by_frame_kernel():
    @kernel
    def pixel_patches_by_frame(pixels, values, out, patch, merge, temporal):
        # one block per patch (grid-stride), threads along its p * p pixels: each thread finds its pixel
        # once, looks each channel's byte up once and writes the value to the channel's T frames
        num_patches, dim = out.shape
        channels = pixels.shape[2]
        per_frame = patch * patch
        per_channel = temporal * per_frame
        windows_w = pixels.shape[1] // (patch * merge)
        for n in range(cuda.blockIdx.x, num_patches, cuda.gridDim.x):
            window, inner = n // (merge * merge), n % (merge * merge)
            y0 = ((window // windows_w) * merge + inner // merge) * patch
            x0 = ((window % windows_w) * merge + inner % merge) * patch
            for r in range(cuda.threadIdx.x, per_frame, cuda.blockDim.x):
                y, x = y0 + r // patch, x0 + r % patch
                for c in range(channels):
                    value = values[c, pixels[y, x, c]]
                    for t in range(temporal):
                        out[n, c * per_channel + t * per_frame + r] = value

    return pixel_patches_by_frame


def pixel_patches_cuda(pixels, values, out, patch: int, merge: int, temporal: int, stream=0):
    """out = pixel_patches_ref(pixels, values, patch, merge, temporal) on the device."""
    require("pixels", pixels, np.uint8, ndim=3)
    height, width, channels = pixels.shape
    if height % (patch * merge) or width % (patch * merge):
        raise ValueError(f"a {width} x {height} image: its sides must be multiples of {patch * merge}")
    require("values", values, np.float32, shape=(channels, BYTE_VALUES))
    require("out", out, np.float32, shape=patches_shape(pixels.shape, patch, temporal))
    if out.shape[0] and BY_FRAME:
        _pixel_patches_by_frame_kernel()[blocks(out.shape[0]), threads(min(patch * patch, 256)), stream](
            pixels, values, out, patch, merge, temporal)
    elif out.shape[0]:
        _pixel_patches_kernel()[blocks(out.shape[0]), threads(256), stream](pixels, values, out, patch, merge)
    return out
