"""``image_url`` parts of a chat request: take the image files out of the messages (each part
becomes ``{"type": "image"}``, which the chat template renders as the model's image placeholder)
and check each one fully here, in the api's own threads, so that the broker's loop never decodes an
image and a bad one is refused before the vision worker starts. ``data:`` URLs always; http(s) URLs
only under one of ``vision.allowed_url_prefixes`` (none by default: the server fetches nothing),
within ``vision.fetch_deadline_s`` (api/image_fetch.py)."""
from __future__ import annotations

import base64
import binascii
import urllib.parse

import requests

from moebus.api.image_fetch import fetch
from moebus.common.errors import RequestError
from moebus.common.images import ImageLimits, check_bytes, decode_image


def _where(n: int, k: int) -> str:
    return f"messages[{n}].content[{k}].image_url"


def _url(part: dict) -> str:
    image = part.get("image_url")
    return image if isinstance(image, str) else image["url"]  # the schema checked that one exists


def _from_data_url(url: str, limits: ImageLimits, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise RequestError(f"{where}: a data URL must read data:image/<type>;base64,<data>", param=where,
                           code="invalid_image_url")
    check_bytes(len(payload) * 3 // 4 - 2, limits, where)  # refuse a huge payload before decoding it
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the data URL is not valid base64", param=where,
                           code="invalid_image_url") from None


def _under(url: str, prefix: str) -> bool:
    """Does ``url`` lie under ``prefix``, ending at a boundary (``https://images.internal`` does
    not admit ``https://images.internal.evil.example/``)?"""
    return url.startswith(prefix) and (prefix.endswith("/") or len(url) == len(prefix) or url[len(prefix)] in "/?#")


def _allowed_url(url: str, prefixes: list[str]) -> str | None:
    """The URL as requests prepares it, the form that the fetch sends (``/ok/../x`` resolved to
    ``/x``), when that lies under an allowed prefix; None when not, or when it hides a way out: user
    info before the host, or dot segments spelled with percent escapes (``%2e%2e``), which servers
    resolve themselves."""
    try:
        sent = requests.Request("GET", url).prepare().url
    except (requests.RequestException, ValueError):
        return None
    parts = urllib.parse.urlsplit(sent)
    path = "/" + urllib.parse.unquote(parts.path).replace("\\", "/") + "/"
    if "@" in parts.netloc or "/../" in path or "/./" in path:
        return None
    return sent if any(_under(sent, prefix) for prefix in prefixes) else None


def _image_bytes(url: str, vision, limits: ImageLimits, where: str) -> bytes:
    if url.startswith("data:"):
        return _from_data_url(url, limits, where)
    if url.startswith(("http://", "https://")):
        allowed = _allowed_url(url, vision.allowed_url_prefixes)
        if allowed is not None:
            return fetch(allowed, limits, where, vision.fetch_timeout_s, vision.fetch_deadline_s)
        raise RequestError(f"{where}: http(s) image URLs are not fetched unless vision.allowed_url_prefixes lists "
                           "them; send the image as a data: URL", param=where, code="image_url_not_allowed")
    raise RequestError(f"{where}: image URLs must be data: URLs (or http(s) under vision.allowed_url_prefixes)",
                       param=where, code="invalid_image_url")


def count_images(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if part.get("type") == "image_url")


def take_images(messages: list[dict], vision) -> tuple[list[dict], list[bytes]]:
    """(messages with each image_url part replaced by an image placeholder part, the image files in
    order). Raises RequestError (400) or ImageTooLarge (413) naming the part."""
    num_images = count_images(messages)
    if num_images > vision.max_images_per_request:
        raise RequestError(f"{num_images} images in one request; at most {vision.max_images_per_request} "
                           "(vision.max_images_per_request)", param="messages", code="too_many_images")
    limits = ImageLimits.from_settings(vision)
    images, out = [], []
    for n, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for k, part in enumerate(content):
            if part.get("type") != "image_url":
                parts.append(part)
                continue
            where = _where(n, k)
            data = _image_bytes(_url(part), vision, limits, where)
            decode_image(data, limits, where).close()
            images.append(data)
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images

