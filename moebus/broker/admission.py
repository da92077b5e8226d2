"""Turn a GENERATE into a Sequence: pick and tokenize the prompt, check it against the model and the
context, fill defaults. Every problem is a RequestError naming the field (HTTP 400)."""
from __future__ import annotations

from jinja2 import TemplateError

from moebus.broker.sequence import Sequence
from moebus.common.errors import RequestError
from moebus.common.protocol import Generate
from moebus.common.tokenizer import StreamDecoder, TextTokenizer

KNOWN_PARTS = {"text", "image_url", "image", "input_image"}
IMAGE_PARTS = KNOWN_PARTS - {"text"}


def _check_messages(messages: list[dict]) -> None:
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{n}] needs a string 'role'", param=f"messages.{n}.role")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(f"messages[{n}].content must be a string or a list of parts", param=f"messages.{n}.content")
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in KNOWN_PARTS:
                raise RequestError(f"messages[{n}].content[{k}] has unknown type {kind!r}",
                                   param=f"messages.{n}.content.{k}.type")
            if kind in IMAGE_PARTS:
                raise RequestError("model has no vision: image inputs are not supported",
                                   param=f"messages.{n}.content.{k}", code="model_has_no_vision")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{n}].content[{k}] needs a string 'text'",
                                   param=f"messages.{n}.content.{k}.text")


def prompt_ids(msg: Generate, tokenizer: TextTokenizer, vocab_size: int) -> list[int]:
    given = [x is not None for x in (msg.prompt, msg.prompt_tokens, msg.messages)]
    if sum(given) != 1:
        raise RequestError("give exactly one of prompt, prompt_tokens or messages", param="prompt")
    if msg.messages is not None:
        if not msg.messages:
            raise RequestError("messages must not be empty", param="messages")
        _check_messages(msg.messages)
        try:
            ids = tokenizer.encode_chat(msg.messages)
        except (TypeError, ValueError, LookupError, TemplateError) as e:  # the template met a shape it cannot render
            raise RequestError(f"the chat template cannot render these messages: {e}", param="messages") from None
    elif msg.prompt_tokens is not None:
        ids = list(msg.prompt_tokens)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", param="prompt")
    else:
        ids = tokenizer.encode(msg.prompt)
    if not ids:
        raise RequestError("the prompt is empty", param="prompt")
    return ids


def make_sequence(msg: Generate, client: bytes, tokenizer: TextTokenizer, vocab_size: int,
                  max_context: int) -> Sequence:
    ids = prompt_ids(msg, tokenizer, vocab_size)
    if len(ids) >= max_context:
        raise RequestError(f"the prompt has {len(ids)} tokens; max_context is {max_context}",
                           param="messages" if msg.messages is not None else "prompt", code="context_length_exceeded")
    sampling = msg.sampling
    outside = [t for t, _ in sampling.logit_bias if t >= vocab_size]
    if outside:
        raise RequestError(f"logit_bias names token id {outside[0]}, outside the vocabulary (size {vocab_size})",
                           param="logit_bias")
    room = max_context - len(ids)
    if sampling.max_tokens is not None and sampling.max_tokens > room:
        raise RequestError(f"max_tokens {sampling.max_tokens} with a prompt of {len(ids)} tokens exceeds "
                           f"max_context {max_context}", param="max_tokens", code="context_length_exceeded")
    if sampling.max_tokens is None:
        sampling = sampling.model_copy(update={"max_tokens": room})
    return Sequence(id=msg.id, client=client, prompt=ids, sampling=sampling, decoder=StreamDecoder(tokenizer),
                    stop_ids=tokenizer.stop_ids, max_context=max_context)
