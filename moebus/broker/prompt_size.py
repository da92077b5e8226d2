"""Bounded work before a too-long prompt is refused, and its memory given back after.

Tokenizing a 3 MiB prompt builds ~400 MB of encoding (ids, offsets, token strings) only to refuse
it against ``max_context``, and glibc keeps what the tokenizer threads freed: the broker's RSS grew
by that much per refused prompt and stayed there. So the size is measured first: no token of the
tokenizer stands for more than ``max_token_bytes`` bytes of text, and a character is at least one
byte, so a text of more than ``max_tokens * max_token_bytes`` characters holds more than
``max_tokens`` tokens whatever it says, and is refused without being rendered or tokenized (a chat
template only adds text around the messages). A text under that bound but much longer than the
context could be (a large context, a vocabulary with long tokens) has a prefix tokenized first: when
the prefix alone has too many tokens, the rest is never tokenized. After any large prompt, refused or
not, the threads' freed memory goes back to the system (``malloc_trim``)."""
from __future__ import annotations

import ctypes
import functools
import logging

from moebus.common.errors import RequestError

log = logging.getLogger("moebus.broker")
LARGE_PROMPT_CHARS = 1 << 18  # after a prompt this long, freed heap goes back to the system
PREFIX_CHARS_PER_TOKEN = 8  # a longer text has this many characters a token tokenized first (~2x English)


@functools.lru_cache(maxsize=8)
def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of any token's string (an upper bound on the text one token covers:
    byte-level and metaspace vocabularies spell each byte with at least one byte)."""
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token.encode()) for token in vocab), default=1) or 1


def prompt_chars(msg) -> int:
    """Characters of the text a GENERATE or TOKENIZE would render and tokenize (0: token ids given)."""
    if getattr(msg, "prompt", None) is not None:
        return len(msg.prompt)
    total = 0
    for message in getattr(msg, "messages", None) or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


def refuse_oversized(msg, tokenizer, max_tokens: int, what: str, code: str = "context_length_exceeded") -> None:
    """RequestError when the prompt's text alone must hold more than ``max_tokens`` tokens."""
    chars = prompt_chars(msg)
    per_token = max_token_bytes(tokenizer)
    if chars > max_tokens * per_token:
        param = "messages" if getattr(msg, "messages", None) is not None else "prompt"
        raise RequestError(f"the prompt has {chars} characters, more than the {max_tokens} tokens of {what} can hold "
                           f"(a token of this model covers at most {per_token} bytes)", param=param, code=code)


def refuse_by_prefix(text: str, tokenizer, max_tokens: int, param: str) -> None:
    """RequestError when about the first ``PREFIX_CHARS_PER_TOKEN * max_tokens`` characters of
    ``text`` already hold more than ``max_tokens`` tokens. The prefix ends before a space, so the
    words in it are tokenized as in the whole text (pre-tokenizers split at spaces, a space going
    with the word after it) and its count is not above the whole's; without a space, no prefix."""
    prefix_chars = PREFIX_CHARS_PER_TOKEN * max_tokens
    cut = text.rfind(" ", 0, prefix_chars) if len(text) > prefix_chars else -1
    if cut <= 0:
        return
    count = len(tokenizer.encode(text[:cut]))
    if count > max_tokens:
        raise RequestError(f"the prompt has more than {max_tokens} tokens (its first {prefix_chars} characters hold "
                           f"{count}); max_context is {max_tokens}", param=param, code="context_length_exceeded")


def give_back_memory(msg) -> None:
    """After a large prompt: return the heap its tokenizing freed to the system."""
    if prompt_chars(msg) >= LARGE_PROMPT_CHARS:
        _malloc_trim()


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None  # not glibc: nothing to trim


def _malloc_trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
