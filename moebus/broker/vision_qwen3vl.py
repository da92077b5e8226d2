"""Qwen3-VL requests in the broker. Admission: every image's token count comes from its header
(the smart resize needs only the size), the prompt's ``<|image_pad|>`` tokens are counted against
the images and expanded, and the prompt's M-RoPE positions and rope offset are computed once
(common/qwen3vl_positions.py). Steps: every stage gets the rope positions of the tokens it runs
(the prompt's own, then index + offset) and the DeepStack rows inside the step. Video is refused."""
from __future__ import annotations

import numpy as np

from moebus.broker.admission import make_sequence
from moebus.broker.vision_groups import image_keys
from moebus.broker.vision_requests import ImageRequest, _check_parts, check_image_tokens
from moebus.common.errors import ConfigError, RequestError
from moebus.common.images import ImageLimits, check_header
from moebus.common.protocol import Generate
from moebus.common.qwen3vl_positions import expand_image_pads, rope_index, step_rope_positions
from moebus.cuda.memory.context_limits import vision_context_mib

VIDEO_PARTS = ("video", "video_url", "input_video")


def refuse_video(msg: Generate) -> None:
    """A clear 400 for video parts (Qwen3-VL reads videos; moebus serves images only)."""
    for n, message in enumerate(msg.messages or []):
        content = message.get("content") if isinstance(message, dict) else None
        for k, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in VIDEO_PARTS:
                where = f"messages[{n}].content[{k}]"
                raise RequestError(f"{where}: video inputs are not supported (images only)", param=where,
                                   code="video_not_supported")


def image_grids(msg: Generate, vision, processor) -> list[tuple[int, int]]:
    """(grid_h, grid_w) per image from its header; raises RequestError for a bad or too large image."""
    images = msg.images or []
    if len(images) > vision.max_images_per_request:
        raise RequestError(f"{len(images)} images in one request; at most {vision.max_images_per_request} "
                           "(vision.max_images_per_request)", param="images", code="too_many_images")
    limits, grids = ImageLimits.from_settings(vision), []
    for i, image in enumerate(images):
        width, height = check_header(image.tobytes(), limits, f"images[{i}]")
        try:
            grids.append(processor.grid(width, height))
        except RequestError as e:
            raise RequestError(f"images[{i}]: {e.message}", param=f"images[{i}]", code="invalid_image") from None
    return grids


def admit_qwen3vl_request(msg: Generate, client: bytes, tokenizer, vocab_size: int, max_context: int, vision, cfg,
                          processor) -> ImageRequest:
    """An ImageRequest for a GENERATE with images for a Qwen3-VL model; raises RequestError."""
    refuse_video(msg)
    grids = image_grids(msg, vision, processor)
    _check_parts(msg.messages)
    counts = [cfg.tokens_for_grid(h, w) for h, w in grids]

    def expand(ids: list[int]) -> list[int]:
        check_image_tokens(ids, msg, tokenizer, cfg.image_token_id, len(grids))
        return expand_image_pads(ids, cfg.image_token_id, counts)

    seq = make_sequence(msg, client, tokenizer, vocab_size, max_context, allow_images=True, prepare_ids=expand)
    seq.embed_positions = np.flatnonzero(np.asarray(seq.prompt) == cfg.image_token_id).astype(np.int32)
    seq.rope_positions, seq.rope_delta = rope_index(seq.prompt, cfg.image_token_id, grids, cfg.merge_size)
    grouped = msg.image_group is not None and msg.image_group_size > 1
    return ImageRequest(seq, list(msg.images or []), group=msg.image_group if grouped else None,
                        group_size=msg.image_group_size, keys=image_keys(msg.images) if grouped else [])


def stacked_embeds(embeds: np.ndarray, deepstack: np.ndarray | None, rows: int) -> np.ndarray | None:
    """ENCODE_REPLY's embeddings and DeepStack features as one (1 + L, rows, D) array (what a group
    shares); None when their shapes do not fit ``rows`` image tokens. Qwen3-VL's vision worker sends
    them stacked already (``embeds`` (1 + L, rows, D), no ``deepstack``): taken as they are."""
    if embeds is not None and embeds.ndim == 3 and deepstack is None:
        return embeds.astype(np.float32, copy=False) if embeds.shape[0] >= 1 and embeds.shape[1] == rows else None
    if embeds is None or embeds.ndim != 2 or embeds.shape[0] != rows:
        return None
    if deepstack is None:
        return embeds
    if deepstack.ndim != 3 or deepstack.shape[1:] != embeds.shape:
        return None
    return np.concatenate([embeds[None], deepstack]).astype(np.float32, copy=False)


def attach_embeds(seq, embeds: np.ndarray) -> None:
    """A sequence takes its images' rows: (rows, D), or (1 + L, rows, D) with DeepStack."""
    if embeds.ndim == 3:
        seq.embeds, seq.deepstack = embeds[0], embeds[1:]
    else:
        seq.embeds = embeds


def step_qwen3vl(seqs, starts, lengths, first_layer: int = 0) -> dict:
    """The STEP fields for Qwen3-VL sequences with images, for the stage whose layers start at
    ``first_layer``: rope positions of all the step's tokens, and the DeepStack rows inside the step
    when the stage holds a DeepStack layer; {} when no sequence of the step has images."""
    if all(seq.rope_positions is None for seq in seqs):
        return {}
    positions, rows, chunks, offset = [], [], [], 0
    for seq, start, length in zip(seqs, starts, lengths):
        start, length = int(start), int(length)
        positions.append(step_rope_positions(seq.rope_positions, seq.rope_delta, start, length))
        if seq.deepstack is not None and len(seq.embed_positions) and first_layer < seq.deepstack.shape[0]:
            lo, hi = np.searchsorted(seq.embed_positions, [start, start + length])
            if hi > lo:
                rows.append(seq.embed_positions[lo:hi] - start + offset)
                chunks.append(seq.deepstack[:, lo:hi])
        offset += length
    out = {"rope_positions": np.concatenate(positions).astype(np.int32)}
    if chunks:  # one sequence's rows: its own array where they are all of it (no copy of ~24 MB a 1024 px image)
        deepstack = chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=1)
        out.update(deepstack=np.ascontiguousarray(deepstack, dtype=np.float32),
                   deepstack_rows=np.concatenate(rows).astype(np.int32))
    return out


def cuda_vision_mib(cfg, processor) -> int:
    """What the vision GPU's cache hands back for a Qwen3-VL tower on cuda: the context, the tower's
    bf16 weights, one encode's scratch for the reference image (workers/qwen3vl_vision.py) and what a
    first encode loads beside it (vision_model.FIRST_ENCODE_LOADS_BYTES: cuBLAS's start, the modules)."""
    from moebus.workers.qwen3vl_vision import STREAM_SLOTS, encode_scratch_bytes, reference_patches
    from moebus.workers.vision_model import FIRST_ENCODE_LOADS_BYTES
    from moebus.workers.qwen3vl_weights import weight_bytes
    from moebus.workers.tower_stream import stream_layers_from_env

    # streamed blocks (workers/tower_stream.py): three on the device. (A value the worker refuses stops its
    # start with a config error; here it only sizes the reserve, as resident.)
    try:
        slots = STREAM_SLOTS if stream_layers_from_env(tower=cfg.tower) else 0
    except ConfigError:
        slots = 0
    need = (weight_bytes(cfg, 2, slots) + encode_scratch_bytes(cfg, reference_patches(cfg, processor))
            + FIRST_ENCODE_LOADS_BYTES)
    return vision_context_mib(cfg.tower) + -(-need // (1 << 20))
