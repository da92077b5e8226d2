"""Image files from clients: the limits they must meet and the one way moebus opens them. The api
checks each image fully (``decode_image``) before it sends the file on; the broker checks the
header of a ZeroMQ client's image (``check_header``, cheap: no pixel is decoded); the vision
worker decodes with ``decode_image`` again. The pixel count is read from the header and refused
before any pixel is decoded, so a decompression bomb costs nothing. Messages never quote Pillow's
errors (they name memory addresses of Python objects)."""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

from moebus.common.errors import RequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageTooLarge(RequestError):
    """An image over vision.max_image_bytes or vision.max_image_pixels (HTTP 413)."""

    http_status = 413


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    min_side_px: int = 2
    max_aspect_ratio: float = 20.0

    @classmethod
    def from_settings(cls, vision) -> "ImageLimits":
        return cls(vision.max_image_bytes, vision.max_image_pixels, vision.min_image_side_px, vision.max_aspect_ratio)


def _open(data: bytes, where: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Pillow warns (and past twice its own limit raises) on huge sizes; ours is checked next
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise ImageTooLarge(f"{where}: the image has too many pixels", param=where, code="image_too_large") from None
    except Exception:  # noqa: BLE001 - Pillow raises many types for garbage; none of their text is echoed
        raise RequestError(f"{where}: not a PNG, JPEG, WebP or GIF image", param=where, code="invalid_image") from None


def _check_size(image: Image.Image, limits: ImageLimits, where: str) -> tuple[int, int]:
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageTooLarge(f"{where}: {width}x{height} pixels exceed vision.max_image_pixels ({limits.max_pixels})",
                            param=where, code="image_too_large")
    if min(width, height) < limits.min_side_px:
        raise RequestError(f"{where}: {width}x{height} pixels: each side needs at least {limits.min_side_px} "
                           "(vision.min_image_side_px)", param=where, code="invalid_image")
    if max(width, height) > limits.max_aspect_ratio * min(width, height):
        raise RequestError(f"{where}: {width}x{height} pixels: the aspect ratio exceeds vision.max_aspect_ratio "
                           f"({limits.max_aspect_ratio:g})", param=where, code="invalid_image")
    return width, height


def check_bytes(num_bytes: int, limits: ImageLimits, where: str) -> None:
    if num_bytes > limits.max_bytes:
        raise ImageTooLarge(f"{where}: {num_bytes} bytes exceed vision.max_image_bytes ({limits.max_bytes})",
                            param=where, code="image_too_large")
    if num_bytes == 0:
        raise RequestError(f"{where}: the image is empty", param=where, code="invalid_image")


def check_header(data: bytes, limits: ImageLimits, where: str) -> tuple[int, int]:
    """(width, height) from the file's header; raises RequestError / ImageTooLarge. Decodes nothing."""
    check_bytes(len(data), limits, where)
    with _open(data, where) as image:
        return _check_size(image, limits, where)


def decode_image(data: bytes, limits: ImageLimits, where: str) -> Image.Image:
    """The image's first frame (GIF, animated WebP), fully decoded; raises RequestError for a
    file that is not a complete image of an allowed format and size."""
    check_bytes(len(data), limits, where)
    image = _open(data, where)
    _check_size(image, limits, where)
    try:
        image.seek(0)
        image.load()  # a truncated file fails here, not later inside preprocessing
    except Exception:  # noqa: BLE001
        raise RequestError(f"{where}: the image data is truncated or corrupt", param=where,
                           code="invalid_image") from None
    return image
