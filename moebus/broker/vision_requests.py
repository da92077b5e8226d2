"""Requests for a vision model in the broker: admission (the images' headers checked, the prompt's
image tokens counted against the images, with or without images, and expanded to the model's
number per image) and, once encoded, the rows of each step's tokens that carry image embeddings
(a prefill chunk carries only those inside it)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from moebus.broker.admission import make_sequence
from moebus.broker.sequence import Sequence
from moebus.broker.vision_groups import image_keys
from moebus.common.errors import RequestError
from moebus.common.image_processor import expand_image_tokens
from moebus.common.images import ImageLimits, check_header
from moebus.common.protocol import Generate


@dataclass(eq=False)  # one request is one object: found and removed by identity
class ImageRequest:
    """A sequence that waits for its image embeddings before it may be scheduled."""

    seq: Sequence
    images: list[np.ndarray]
    arrived_s: float = field(default_factory=time.monotonic)
    encode_sent_s: float | None = None
    group: str | None = None  # GENERATE's image_group: the choices sharing one encode (broker/vision_groups.py)
    group_size: int = 1
    keys: list[bytes] = field(default_factory=list)  # the images' digests, for a group member


def has_images(msg: Generate) -> bool:
    """Image frames, or image parts (a placeholder then needs a frame; an HTTP-only part is refused)."""
    return bool(msg.images) or any(isinstance(part, dict) and part.get("type") in ("image", "image_url", "input_image")
                                   for m in msg.messages or [] if isinstance(m, dict)
                                   for part in (m.get("content") if isinstance(m.get("content"), list) else []))


def _check_parts(messages: list[dict] | None) -> None:
    for n, message in enumerate(messages or []):
        content = message.get("content") if isinstance(message, dict) else None
        for k, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in ("image_url", "input_image"):
                where = f"messages[{n}].content[{k}]"
                raise RequestError(f"{where}: over ZeroMQ an image is a raw frame of GENERATE's images with a "
                                   "{'type': 'image'} part in its place", param=where)


def check_image_tokens(ids: list[int], msg: Generate, tokenizer, image_token_id: int, num_images: int) -> None:
    """The check every prompt of a vision model passes once tokenized. The image token stands for an
    image wherever it comes from: a ``{"type": "image"}`` part's placeholder, or the token's text
    typed into a text part or a raw prompt, which the tokenizer turns into the same id (as
    LlavaProcessor treats it). So the prompt must hold exactly one per image; otherwise stage 0
    would run image tokens without an image behind them, or images without their tokens."""
    found = ids.count(image_token_id)
    if found != num_images:
        token = tokenizer.tokenizer.id_to_token(image_token_id)
        raise RequestError(f"the prompt holds {found} image token(s) ({token!r}, id {image_token_id}) for "
                           f"{num_images} image(s): each image stands for one, and a text must not carry the "
                           "image token itself", param="messages" if msg.messages is not None else "prompt",
                           code="image_count_mismatch")


def admit_text_request(msg: Generate, client: bytes, tokenizer, vocab_size: int, max_context: int,
                       image_token_id: int) -> Sequence:
    """A GENERATE without images for a vision model: a plain Sequence, once its prompt is known to
    hold no image token; raises RequestError (image_count_mismatch) when it does."""
    def no_image_tokens(ids: list[int]) -> list[int]:
        check_image_tokens(ids, msg, tokenizer, image_token_id, 0)
        return ids

    return make_sequence(msg, client, tokenizer, vocab_size, max_context, prepare_ids=no_image_tokens)


def admit_image_request(msg: Generate, client: bytes, tokenizer, vocab_size: int, max_context: int, vision,
                        image_token_id: int, num_image_tokens: int) -> ImageRequest:
    """An ImageRequest for a GENERATE with images; raises RequestError naming what is wrong."""
    images = msg.images or []
    if len(images) > vision.max_images_per_request:
        raise RequestError(f"{len(images)} images in one request; at most {vision.max_images_per_request} "
                           "(vision.max_images_per_request)", param="images", code="too_many_images")
    limits = ImageLimits.from_settings(vision)
    for i, image in enumerate(images):
        check_header(image.tobytes(), limits, f"images[{i}]")
    _check_parts(msg.messages)

    def expand(ids: list[int]) -> list[int]:
        check_image_tokens(ids, msg, tokenizer, image_token_id, len(images))
        return expand_image_tokens(ids, image_token_id, num_image_tokens)

    seq = make_sequence(msg, client, tokenizer, vocab_size, max_context, allow_images=True, prepare_ids=expand)
    seq.embed_positions = np.flatnonzero(np.asarray(seq.prompt) == image_token_id).astype(np.int32)
    grouped = msg.image_group is not None and msg.image_group_size > 1
    return ImageRequest(seq, images, group=msg.image_group if grouped else None, group_size=msg.image_group_size,
                        keys=image_keys(images) if grouped else [])


def step_embeds(seqs, starts, lengths, skip: int | None = None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(embeds (R, D) float32, rows (R,) int32 of the step's T tokens) for the image tokens that
    this step feeds, or (None, None) when it feeds none. ``skip``: a row whose image rows are not
    sent (the worker holds them: Step.held_row)."""
    chunks, rows, offset = [], [], 0
    for i, (seq, start, length) in enumerate(zip(seqs, starts, lengths)):
        start, length = int(start), int(length)
        if seq.embeds is not None and i != skip:
            positions = seq.embed_positions
            lo, hi = np.searchsorted(positions, [start, start + length])
            if hi > lo:
                rows.append(positions[lo:hi] - start + offset)
                chunks.append(seq.embeds[lo:hi])
        offset += length
    if not chunks:
        return None, None
    if len(chunks) == 1:  # one image prompt in the step (a chunk's rows: 6.2 MB at LLaVA's 756 x 2048): no copy
        return np.ascontiguousarray(chunks[0], np.float32), rows[0].astype(np.int32)
    return np.concatenate(chunks).astype(np.float32, copy=False), np.concatenate(rows).astype(np.int32)
