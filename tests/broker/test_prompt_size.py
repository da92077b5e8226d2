"""Bounded work before a too-long prompt is refused (broker/prompt_size.py), against the tiny
model's tokenizer: the size bound refuses without tokenizing, the prefix count refuses after a bounded
prefix, and neither refuses a prompt that fits."""
from __future__ import annotations

import pytest

from moebus.broker.admission import make_sequence, tokenize
from moebus.broker.prompt_size import max_token_bytes, prompt_chars, refuse_by_prefix, refuse_oversized
from moebus.common.errors import RequestError
from moebus.common.model_config import load_config
from moebus.common.protocol import Generate, Tokenize
from moebus.common.tiny_model import init_model
from moebus.common.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model = init_model(tmp_path_factory.mktemp("tokenizer"), "qwen3_moe", "tiny")
    return TextTokenizer(model, load_config(model).eos_token_ids)


class CountingTokenizer:
    """The tokenizer, counting the characters it was asked to encode."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.encoded_chars = inner, inner.tokenizer, 0

    def encode(self, text):
        self.encoded_chars += len(text)
        return self.inner.encode(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_no_token_covers_more_bytes_than_the_bound(tokenizer):
    bound = max_token_bytes(tokenizer)
    vocab = tokenizer.tokenizer.get_vocab()
    assert bound == max(len(t.encode()) for t in vocab)
    text = "the quick brown fox jumps over the lazy dog " * 50
    assert len(text.encode()) <= bound * len(tokenizer.encode(text))


def test_an_oversized_prompt_is_refused_before_any_tokenizing(tokenizer):
    counting = CountingTokenizer(tokenizer)
    msg = Generate(id="r", prompt="x " * 3_000_000)
    with pytest.raises(RequestError) as err:
        make_sequence(msg, b"c", counting, 384, 256)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert counting.encoded_chars == 0
    chat = Generate(id="r", messages=[{"role": "user", "content": [{"type": "text", "text": "y " * 3_000_000}]}])
    assert prompt_chars(chat) == 6_000_000
    with pytest.raises(RequestError) as err:
        make_sequence(chat, b"c", counting, 384, 256)
    assert err.value.param == "messages" and counting.encoded_chars == 0


def test_a_long_prompt_under_the_bound_has_only_a_prefix_tokenized(tokenizer):
    counting = CountingTokenizer(tokenizer)
    text = "ab cd " * 2_000  # 12 000 characters: over the 8 x 256 of the prefix, ~4 000 tokens
    with pytest.raises(RequestError) as err:
        refuse_by_prefix(text, counting, 256, "prompt")
    assert err.value.code == "context_length_exceeded" and counting.encoded_chars <= 8 * 256


def test_prompts_that_fit_are_not_refused(tokenizer):
    short = Generate(id="r", prompt="hello there " * 10)
    seq = make_sequence(short, b"c", tokenizer, 384, 256)
    assert seq.prompt == tokenizer.encode(short.prompt)
    refuse_oversized(short, tokenizer, 256, "max_context")
    refuse_by_prefix("word " * 100, tokenizer, 256, "prompt")  # shorter than the prefix
    refuse_by_prefix("x" * 5000, tokenizer, 256, "prompt")  # no space to cut at: left to the whole count
    reply = tokenize(Tokenize(id="t", prompt="hello " * 1000), tokenizer, 256)
    assert len(reply.tokens) > 256  # TOKENIZE is bound by its own limit, not max_context
