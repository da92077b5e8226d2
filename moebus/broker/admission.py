"""Turn a GENERATE into a Sequence: pick and tokenize the prompt, check it against the model and the
context, fill defaults. Every problem is a RequestError naming the field (HTTP 400)."""
from __future__ import annotations

from jinja2 import TemplateError

from moebus.broker.grammar import engine_for
from moebus.broker.prompt_size import refuse_by_prefix, refuse_oversized
from moebus.broker.sequence import Sequence
from moebus.common import wire
from moebus.common.errors import RequestError
from moebus.common.protocol import (MAX_TOKENS_PER_PROMPT, Detokenize, DetokenizeReply, Generate, Tokenize,
                                    TokenizeReply)
from moebus.common.tokenizer import StreamDecoder, TextTokenizer

KNOWN_PARTS = {"text", "image_url", "image", "input_image"}
MAX_REPLY_TEXT_BYTES = wire.MAX_HEADER_BYTES // 2  # DETOKENIZE's text, with room for the rest of its header
IMAGE_PARTS = KNOWN_PARTS - {"text"}


def _check_messages(messages: list[dict], allow_images: bool = False) -> None:
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
            if kind == "image" and allow_images:
                continue  # a placeholder: its image came as a raw frame (broker/vision_requests.py)
            if kind in IMAGE_PARTS:
                raise RequestError("model has no vision: image inputs are not supported",
                                   param=f"messages.{n}.content.{k}", code="model_has_no_vision")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{n}].content[{k}] needs a string 'text'",
                                   param=f"messages.{n}.content.{k}.text")


def chat_prompt(msg: Generate | Tokenize, tokenizer: TextTokenizer, add_generation_prompt: bool = True,
                allow_images: bool = False) -> str:
    """The chat template rendered over a request's messages, tools and template variables."""
    if not msg.messages:
        raise RequestError("messages must not be empty", param="messages")
    _check_messages(msg.messages, allow_images)
    try:
        return tokenizer.render_chat(msg.messages, add_generation_prompt, msg.tools, msg.chat_template_kwargs)
    except (TypeError, ValueError, LookupError, TemplateError) as e:  # the template met a shape it cannot render
        raise RequestError(f"the chat template cannot render these messages: {e}", param="messages") from None


def prompt_ids(msg: Generate, tokenizer: TextTokenizer, vocab_size: int, allow_images: bool = False,
               max_context: int = MAX_TOKENS_PER_PROMPT) -> tuple[list[int], str | None]:
    """The prompt's token ids, and its text when a chat template rendered it."""
    given = [x is not None for x in (msg.prompt, msg.prompt_tokens, msg.messages)]
    if sum(given) != 1:
        raise RequestError("give exactly one of prompt, prompt_tokens or messages", param="prompt")
    if (msg.tools or msg.chat_template_kwargs) and msg.messages is None:
        raise RequestError("tools and chat_template_kwargs need messages (a chat request)",
                           param="tools" if msg.tools else "chat_template_kwargs")
    text = None
    refuse_oversized(msg, tokenizer, max_context, "max_context")  # before any rendering or tokenizing
    if msg.messages is not None:
        text = chat_prompt(msg, tokenizer, allow_images=allow_images)
        refuse_by_prefix(text, tokenizer, max_context, "messages")
        ids = tokenizer.encode(text)
    elif msg.prompt_tokens is not None:
        ids = list(msg.prompt_tokens)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", param="prompt")
    else:
        refuse_by_prefix(msg.prompt, tokenizer, max_context, "prompt")
        ids = tokenizer.encode(msg.prompt)
    if not ids:
        raise RequestError("the prompt is empty", param="prompt")
    return ids, text


def make_sequence(msg: Generate, client: bytes, tokenizer: TextTokenizer, vocab_size: int,
                  max_context: int, allow_images: bool = False, prepare_ids=None) -> Sequence:
    """``allow_images``: image placeholder parts are rendered (their images came as frames);
    ``prepare_ids``: a last say on the token ids before the context checks (image expansion)."""
    ids, text = prompt_ids(msg, tokenizer, vocab_size, allow_images, max_context)
    if prepare_ids is not None:
        ids = prepare_ids(ids)
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
    if sampling.top_k >= vocab_size:  # every token is in the top k: the same as no top-k at all
        sampling = sampling.model_copy(update={"top_k": 0})
    # where a reasoning block stands at the prompt's end, for the api's reasoning split
    reasoning_open = tokenizer.opens_reasoning(text) if text is not None else None
    # structured output: compiled here, on a tokenizer thread (a slow schema never holds the loop)
    grammar = engine_for(tokenizer, vocab_size).start(msg.constraint, reasoning_open) if msg.constraint else None
    return Sequence(id=msg.id, client=client, prompt=ids, sampling=sampling, decoder=StreamDecoder(tokenizer),
                    stop_ids=tokenizer.stop_ids, max_context=max_context, reasoning_open=reasoning_open,
                    grammar=grammar)


def tokenize(msg: Tokenize, tokenizer: TextTokenizer, max_context: int) -> TokenizeReply:
    """TOKENIZE: the ids that GENERATE would feed for the same prompt or messages."""
    if (msg.prompt is None) == (msg.messages is None):
        raise RequestError("give exactly one of prompt or messages", param="prompt")
    refuse_oversized(msg, tokenizer, MAX_TOKENS_PER_PROMPT, "a TOKENIZE reply", code="too_many_tokens")
    if msg.messages is not None:
        _refuse_image_parts(msg.messages)
        ids = tokenizer.encode(chat_prompt(msg, tokenizer, msg.add_generation_prompt))
    elif msg.tools or msg.chat_template_kwargs:
        raise RequestError("tools and chat_template_kwargs need messages", param="tools" if msg.tools else
                           "chat_template_kwargs")
    else:
        ids = tokenizer.encode(msg.prompt)
    if len(ids) > MAX_TOKENS_PER_PROMPT:  # a longer reply would exceed the wire's array limit and be lost
        raise RequestError(f"the prompt has {len(ids)} tokens; TOKENIZE answers at most {MAX_TOKENS_PER_PROMPT}",
                           param="messages" if msg.messages is not None else "prompt", code="too_many_tokens")
    strs = [tokenizer.tokenizer.id_to_token(t) for t in ids] if msg.token_strs else None
    return TokenizeReply(id=msg.id, tokens=ids, token_strs=strs, max_context=max_context)


def _refuse_image_parts(messages: list[dict]) -> None:
    """TOKENIZE renders no images, on any model (chat_prompt would say 'model has no vision')."""
    for n, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        for k, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                raise RequestError(f"messages[{n}].content[{k}]: /tokenize takes no images (a chat completion's "
                                   "usage counts an image's tokens)", param=f"messages.{n}.content.{k}",
                                   code="not_supported")


def detokenize(msg: Detokenize, tokenizer: TextTokenizer, vocab_size: int) -> DetokenizeReply:
    """DETOKENIZE: the text of ids, special tokens kept (so a tokenized chat prompt reads back whole)."""
    bad = [t for t in msg.tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", param="tokens")
    text = tokenizer.tokenizer.decode(msg.tokens, skip_special_tokens=False)
    if len(text) * 4 > MAX_REPLY_TEXT_BYTES and len(text.encode()) > MAX_REPLY_TEXT_BYTES:
        # a million long tokens (runs of spaces, rules of '=') outgrow the header that would carry the
        # text, and the client would drop the reply unread
        raise RequestError(f"the text of these {len(msg.tokens)} tokens exceeds {MAX_REPLY_TEXT_BYTES} bytes; "
                           "detokenize fewer at a time", param="tokens", code="too_many_tokens")
    return DetokenizeReply(id=msg.id, text=text)
