"""Hostile images get a fast 400 or 413 OpenAI error naming the part (never an address or internal
state), before the vision worker is started or touched, and leave the worker and the caches as
they were; over ZeroMQ the same, with the images named by frame."""
import http.server
import re
import struct
import threading
import time
import zlib

import pytest
import requests

from moebus.client import Client
from moebus.common.errors import RequestError
from tests.e2e.vision_helpers import data_url, png_bytes, start_vision_service, vision_state
from tests.vision_models import sample_images

MAX_IMAGE_BYTES = 256 * 1024
GOOD = png_bytes(sample_images()[0])


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(side: int = 30000) -> bytes:
    """A valid 1-bit PNG of side x side pixels (~112 MB decoded) that compresses to ~100 KB."""
    rows = zlib.compressobj(9)
    row = b"\0" * (1 + side // 8)
    body = b"".join(rows.compress(row * 1000) for _ in range(side // 1000)) + rows.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


class _Images(http.server.BaseHTTPRequestHandler):
    """A loopback web server: /ok/cat.png is an image, /ok/moved redirects to it."""

    def do_GET(self):  # noqa: N802 - the http.server API
        if self.path == "/ok/moved":
            self.send_response(302)
            self.send_header("Location", "/ok/cat.png")
            self.end_headers()
            return
        body = GOOD if self.path.endswith("cat.png") else b"no"
        self.send_response(200 if self.path.endswith("cat.png") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_llava, web):
    svc = start_vision_service(tmp_path_factory.mktemp("hostile"), tiny_llava, idle_s=30,
                               max_image_bytes=MAX_IMAGE_BYTES, allowed_url_prefixes=[web + "/ok/"])
    try:
        yield svc
    finally:
        assert svc.stop() == []


@pytest.fixture(scope="module")
def zmq(service):
    client = Client(service.zmq_address, timeout_s=30)
    yield client
    client.close()


def _chat(service, url: str, count: int = 1) -> requests.Response:
    parts = [{"type": "text", "text": "look"}] + [{"type": "image_url", "image_url": {"url": url}}] * count
    return requests.post(service.base_url + "/v1/chat/completions", timeout=30,
                         json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})


def _big_noise_png() -> bytes:
    import numpy as np
    from PIL import Image

    return png_bytes(Image.fromarray(np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8)))


HOSTILE = {
    "bad_base64": ("data:image/png;base64,!!not*base64", 1, 400, "invalid_image_url"),
    "not_an_image": (data_url(b"hello, world " * 20), 1, 400, "invalid_image"),
    "truncated": (data_url(GOOD[: len(GOOD) // 2]), 1, 400, "invalid_image"),
    "one_pixel": (data_url(png_bytes(sample_images()[0].resize((1, 1)))), 1, 400, "invalid_image"),
    "png_bomb": (data_url(png_bomb()), 1, 413, "image_too_large"),
    "too_many_bytes": (data_url(_big_noise_png()), 1, 413, "image_too_large"),
    "too_many_images": (data_url(GOOD), 9, 400, "too_many_images"),
    "http_url": ("http://127.0.0.1:1/cat.png", 1, 400, "image_url_not_allowed"),
    "not_a_data_image": ("data:text/plain;base64,aGVsbG8=", 1, 400, "invalid_image_url"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_images_are_refused_fast_and_harm_nothing(service, zmq, name):
    url, count, status, code = HOSTILE[name]
    before = vision_state(zmq)
    started = time.monotonic()
    response = _chat(service, url, count)
    assert time.monotonic() - started < 2.0
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert error["param"] == ("messages" if code == "too_many_images" else "messages[0].content[1].image_url")
    assert not re.search(r"0x[0-9a-f]{6,}|object at|Traceback", error["message"])  # no address, no internals
    after = vision_state(zmq)
    assert (after["state"], after["pid"], after["starts"], after["slots"]) == \
        (before["state"], before["pid"], before["starts"], before["slots"])


def test_after_the_hostile_ones_a_good_image_works_and_the_worker_survives_a_bad_frame(service, zmq):
    assert _chat(service, data_url(GOOD)).status_code == 200
    loaded = vision_state(zmq)
    assert loaded["loaded"] == 1
    content = [{"type": "image"}, {"type": "text", "text": "look"}]
    for frame, where in ((b"GIF89a but not really", "images[0]"), (GOOD[: len(GOOD) // 2], "images[0]")):
        with pytest.raises(RequestError) as err:  # the header check (broker) / the decode (vision worker)
            zmq.chat([{"role": "user", "content": content}], images=[frame], max_tokens=2).collect()
        assert err.value.http_status == 400 and err.value.param == where
    for parts, frames in ((content * 2, [GOOD]), (content, None)):  # placeholders and frames must pair up
        with pytest.raises(RequestError) as err:
            zmq.chat([{"role": "user", "content": parts}], images=frames, max_tokens=2).collect()
        assert err.value.code == "image_count_mismatch"
    assert len(zmq.chat([{"role": "user", "content": content}], images=[GOOD], max_tokens=2).collect()["tokens"]) == 2
    after = vision_state(zmq)
    assert (after["pid"], after["starts"], after["slots"]) == (loaded["pid"], loaded["starts"], loaded["slots"])


def test_tokenize_refuses_an_image_part_without_denying_the_vision(service):
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": data_url(GOOD)}}]
    response = requests.post(service.base_url + "/tokenize", timeout=30,
                             json={"messages": [{"role": "user", "content": parts}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages.0.content.1", "not_supported")  # was model_has_no_vision


def test_a_model_without_vision_refuses_images(tmp_path, tiny_model):
    from tests.service import Service

    svc = Service(tmp_path, tiny_model).wait_ready()
    client = Client(svc.zmq_address, timeout_s=30)
    try:
        assert _chat(svc, data_url(GOOD)).json()["error"]["code"] == "model_has_no_vision"
        with pytest.raises(RequestError) as err:
            client.chat([{"role": "user", "content": [{"type": "image"}]}], images=[GOOD], max_tokens=2).collect()
        assert err.value.code == "model_has_no_vision"
    finally:
        client.close()
        assert svc.stop() == []


def _encoded(fmt: str) -> bytes:
    import io

    frames = sample_images()
    buf = io.BytesIO()
    if fmt == "GIF":  # animated: the first frame is the one encoded
        frames[0].save(buf, "GIF", save_all=True, append_images=[frames[2].convert("RGB").resize(frames[0].size)])
    else:
        frames[0].save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,mime", [("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_jpeg_webp_and_gif_images_are_answered(service, fmt, mime):
    response = _chat(service, data_url(_encoded(fmt), mime))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_http_urls_only_under_an_allowed_prefix_and_without_redirects(service, web):
    assert _chat(service, web + "/ok/cat.png").status_code == 200
    refused = {web + "/elsewhere/cat.png": (400, "image_url_not_allowed"),
               web + "/ok/moved": (400, "image_fetch_failed"),  # a redirect could leave the prefix
               web + "/ok/missing.jpg": (400, "image_fetch_failed"),
               # ways out of the prefix: the web server answers any path ending in cat.png
               web + "/ok/../cat.png": (400, "image_url_not_allowed"),  # requests resolves it to /cat.png
               web + "/ok/%2e%2e/cat.png": (400, "image_url_not_allowed"),  # sent as is; servers resolve it
               web + "/ok/.%2E/cat.png": (400, "image_url_not_allowed"),
               web + "/ok%2f..%2fcat.png": (400, "image_url_not_allowed")}
    for url, (status, code) in refused.items():
        response = _chat(service, url)
        assert (response.status_code, response.json()["error"]["code"]) == (status, code), url


def test_a_prefix_admits_only_urls_under_it():
    from moebus.api.images import _allowed_url

    prefixes = ["https://images.internal", "http://127.0.0.1:9/ok/"]
    assert _allowed_url("https://images.internal/a.png", prefixes) == "https://images.internal/a.png"
    assert _allowed_url("http://127.0.0.1:9/ok/b/../a.png", prefixes) == "http://127.0.0.1:9/ok/a.png"
    for url in ("https://images.internal.evil.example/a.png", "https://images.internal@evil.example/a.png",
                "https://images.internal:1@evil.example/", "http://127.0.0.1:9/ok/..%5ca.png", "http://[::1/ok/"):
        assert _allowed_url(url, prefixes) is None, url
