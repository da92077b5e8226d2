"""Hostile images get a fast 400 or 413 OpenAI error naming the part (never an address or internal
state), before the vision worker is started or touched, and leave the worker and the caches as
they were; over ZeroMQ the same, with the images named by frame."""
import http.server
import os
import re
import signal
import struct
import threading
import time
import zlib
from contextlib import closing

import pytest
import requests

from moebus.client import Client
from moebus.common.errors import RequestError
from tests.api.helpers import openai_sdk, scrape, wait_for
from tests.e2e.vision_helpers import data_url, image_message, png_bytes, vision_service, vision_state
from tests.service import running
from tests.vision_models import sample_images

MAX_IMAGE_BYTES = 256 * 1024
FETCH_DEADLINE_S = 3.0  # a fetch of cat.png from loopback takes milliseconds
TRICKLE_S = 0.25
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
    """A loopback web server: /ok/cat.png is an image, /ok/moved redirects to it; /ok/slow.png sends
    its body and /ok/slow-headers.png its headers a byte every TRICKLE_S (well within any per-read
    timeout), for as long as the client listens, then sets ``hung_up``."""

    hung_up = threading.Event()

    def do_GET(self):  # noqa: N802 - the http.server API
        if self.path == "/ok/slow.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(GOOD) * 1000))
            self.end_headers()
            self._trickle(GOOD * 1000)
            return
        if self.path == "/ok/slow-headers.png":
            self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            self._trickle(b"x" * 100_000)
            return
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

    def _trickle(self, data: bytes) -> None:
        for i in range(len(data)):
            try:
                self.wfile.write(data[i:i + 1])
            except OSError:  # the fetch hung up
                type(self).hung_up.set()
                return
            time.sleep(TRICKLE_S)

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
    svc = vision_service(tmp_path_factory.mktemp("hostile"), tiny_llava, idle_s=30, max_image_bytes=MAX_IMAGE_BYTES,
                         allowed_url_prefixes=[web + "/ok/"], fetch_deadline_s=FETCH_DEADLINE_S,
                         broker={"heartbeat_liveness": 30})  # a vision worker may be SIGSTOPped a while
    with running(svc) as ready:
        yield ready


@pytest.fixture(scope="module")
def zmq(service):
    with closing(Client(service.zmq_address, timeout_s=30)) as client:
        yield client


@pytest.fixture(scope="module")
def openai_api(service):
    with openai_sdk(service.base_url) as client:
        yield client


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
        # without a vision tower there is no image token: "<image>" is text like any other
        assert len(client.generate(prompt="what is <image>?", max_tokens=2, ignore_eos=True).collect()["tokens"]) == 2
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


# -- the image token in text, the choices of one request, slow image servers ---------------------

def _image_token_id(zmq) -> int:
    return zmq.tokenize(prompt="<image>")["tokens"][0]


def test_an_image_token_typed_as_text_is_refused_unless_an_image_stands_behind_it(service, zmq, openai_api):
    """The tokenizer turns the text "<image>" into the image token (as LlavaProcessor does): a prompt
    must hold exactly one per image, chat or completion, or stage 0 would run it without an image."""
    import openai

    image_id = _image_token_id(zmq)
    chat, complete = openai_api.chat.completions.create, openai_api.completions.create
    text_part = [{"type": "text", "text": "what is <image>?"}]
    cases = {
        "a text part": (lambda: chat(model="m", max_tokens=2, messages=[{"role": "user", "content": text_part}]),
                        "messages", 1, 0),
        "a string content": (lambda: chat(model="m", max_tokens=2, messages=[{"role": "user", "content": "<image>"}]),
                             "messages", 1, 0),
        "a text part beside an image": (
            lambda: chat(model="m", max_tokens=2, messages=image_message([data_url(GOOD)], "and <image> too")),
            "messages", 2, 1),
        "a completion's prompt": (lambda: complete(model="m", max_tokens=2, prompt="<image> a caption:"),
                                  "prompt", 1, 0),
        "a completion's token ids": (lambda: complete(model="m", max_tokens=2, prompt=[5, image_id, image_id, 7]),
                                     "prompt", 2, 0),
    }
    starts = vision_state(zmq)["starts"]
    for name, (call, param, found, images) in cases.items():
        with pytest.raises(openai.BadRequestError) as err:
            call()
        error = err.value
        assert (error.code, error.param) == ("image_count_mismatch", param), name
        assert f"holds {found} image token(s) ('<image>', id {image_id}) for {images} image(s)" in error.message, name
    assert vision_state(zmq)["starts"] == starts  # refused before any vision worker start
    # over ZeroMQ a raw prompt may place its images with the token, one per image frame
    for prompt in ({"prompt": "<image> a caption:"}, {"prompt_tokens": [5, image_id, 7]}):
        assert len(zmq.generate(**prompt, images=[GOOD], max_tokens=2, ignore_eos=True).collect()["tokens"]) == 2


def _encodes(service) -> tuple[float, float, float]:
    sample = scrape(service.base_url)
    return (sample["moebus_images_total"], sample["moebus_vision_encode_seconds_count"],
            sample["moebus_images_reused_total"])


def test_the_choices_of_one_image_request_share_one_encode(service, openai_api):
    create = openai_api.chat.completions.create
    messages = image_message([data_url(GOOD), data_url(_encoded("JPEG"), "image/jpeg")])
    greedy = dict(model="m", messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    solo = create(**greedy).choices[0].message.content
    before = _encodes(service)
    reply = create(**greedy, n=3)
    images, encodes, reused = (a - b for a, b in zip(_encodes(service), before))
    assert [c.message.content for c in reply.choices] == [solo] * 3  # the shared embeddings are the right ones
    assert (images, encodes, reused) == (2, 1, 4)  # two images encoded once, in one ENCODE, for three choices
    sampled = create(model="m", messages=messages, max_tokens=4, n=2, stream=True, extra_body={"ignore_eos": True})
    assert {c.choices[0].index for c in sampled if c.choices} == {0, 1}
    assert _encodes(service)[1] - before[1] == 2


def test_a_choice_fails_with_the_choice_that_encodes_for_it(service, zmq):
    """Over ZeroMQ the group is explicit: two requests with one image_group; the vision worker cannot
    decode the image (the broker only reads its header), and both get its 400."""
    content = [{"type": "image"}, {"type": "text", "text": "look"}]
    before = _encodes(service)
    streams = [zmq.chat([{"role": "user", "content": content}], images=[GOOD[: len(GOOD) // 2]], max_tokens=2,
                        image_group="bad-pair", image_group_size=2) for _ in range(2)]
    for stream in streams:
        with pytest.raises(RequestError) as err:
            stream.collect()
        assert (err.value.http_status, err.value.code, err.value.param) == (400, "invalid_image", "images[0]")
    assert _encodes(service)[1] - before[1] == 1


def test_a_cancelled_leader_hands_its_encode_in_flight_to_the_next_choice(service, zmq):
    """The vision worker is stopped (SIGSTOP) while the first choice's ENCODE is out; the second
    choice follows it; the first is cancelled: the second takes over that very encode."""
    content = [{"type": "image"}, {"type": "text", "text": "look"}]

    def choice():
        return zmq.chat([{"role": "user", "content": content}], images=[GOOD], max_tokens=2, ignore_eos=True,
                        image_group="handover", image_group_size=2)

    assert len(zmq.chat([{"role": "user", "content": content}], images=[GOOD], max_tokens=2).collect()["tokens"])
    worker = vision_state(zmq)["pid"]
    before = _encodes(service)
    os.kill(worker, signal.SIGSTOP)
    try:
        first = choice()
        wait_for(lambda: vision_state(zmq)["waiting"] == 1 or None, 30)
        second = choice()
        wait_for(lambda: vision_state(zmq)["waiting"] == 2 or None, 30)
        first.close()  # CANCEL
        wait_for(lambda: vision_state(zmq)["waiting"] == 1 or None, 30)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert len(second.collect()["tokens"]) == 2
    assert tuple(a - b for a, b in zip(_encodes(service), before)) == (1, 1, 0)  # the first's encode, not reused
    assert vision_state(zmq)["pid"] == worker
    service.log.flush()
    assert f"image request {first.id} cancelled: {second.id} takes over its encode" in open(service.log.name).read()


@pytest.mark.parametrize("path", ["/ok/slow.png", "/ok/slow-headers.png"])
def test_a_trickling_image_server_is_cut_off_at_the_fetch_deadline(service, web, openai_api, path):
    """A byte every TRICKLE_S passes every per-read timeout (vision.fetch_timeout_s: 10 s); the whole
    fetch still ends at vision.fetch_deadline_s, and the connection is closed, not left behind."""
    import openai

    _Images.hung_up.clear()
    with pytest.raises(openai.BadRequestError) as err:
        openai_api.chat.completions.create(model="m", max_tokens=2, messages=image_message([web + path]))
    assert (err.value.code, err.value.param) == ("image_fetch_failed", "messages[0].content[0].image_url")
    assert f"vision.fetch_deadline_s, {FETCH_DEADLINE_S:g} s" in err.value.message
    assert _Images.hung_up.wait(30)  # the server's next writes failed: the fetch hung up
