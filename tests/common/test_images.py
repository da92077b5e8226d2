"""The image limits: what check_header refuses without decoding, what decode_image refuses after,
and that no error quotes Pillow (whose messages name memory addresses)."""
import io
import re
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from moebus.common.errors import RequestError
from moebus.common.images import ImageLimits, ImageTooLarge, check_header, decode_image

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=10_000, min_side_px=2, max_aspect_ratio=4.0)


def _file(size, fmt="PNG", mode="RGB") -> bytes:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, fmt)
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """An IHDR that claims width x height and no pixel data worth the name."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_allowed_formats_decode(fmt):
    image = decode_image(_file((40, 30), fmt), LIMITS, "x")
    assert image.size == (40, 30)


def test_the_pixel_count_is_refused_from_the_header_alone():
    bomb = _png_header(60_000, 60_000)  # Pillow's own limit would raise; ours speaks first or alike
    for check in (check_header, decode_image):
        with pytest.raises(ImageTooLarge) as err:
            check(bomb, LIMITS, "messages[0].content[0].image_url")
        assert err.value.http_status == 413 and err.value.param == "messages[0].content[0].image_url"
    with pytest.raises(ImageTooLarge, match="exceed vision.max_image_pixels"):
        check_header(_png_header(200, 200), LIMITS, "x")


@pytest.mark.parametrize("data,match", [
    (_file((1, 1)), "at least 2"),
    (_file((90, 10)), "aspect ratio"),
    (b"%PDF-1.4 definitely not an image", "not a PNG, JPEG, WebP or GIF"),
    (_file((20, 20), "BMP"), "not a PNG, JPEG, WebP or GIF"),
    (b"", "empty"),
])
def test_refused_before_decoding(data, match):
    with pytest.raises(RequestError, match=match) as err:
        check_header(data, LIMITS, "images[0]")
    assert err.value.http_status == 400 and not re.search(r"0x[0-9a-f]{6,}|object at", err.value.message)


def test_a_truncated_file_passes_the_header_check_and_fails_the_decode():
    data = _file((60, 60))
    half = data[: len(data) // 2]
    assert check_header(half, LIMITS, "images[0]") == (60, 60)
    with pytest.raises(RequestError, match="truncated or corrupt") as err:
        decode_image(half, LIMITS, "images[0]")
    assert "object at" not in err.value.message


def test_too_many_bytes():
    with pytest.raises(ImageTooLarge, match="max_image_bytes"):
        check_header(b"\0" * (LIMITS.max_bytes + 1), LIMITS, "x")


def test_a_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    image = decode_image(buf.getvalue(), LIMITS, "x")
    assert image.convert("RGB").getpixel((0, 0)) == (255, 0, 0)
