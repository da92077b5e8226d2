"""Admission's answers to TOKENIZE stay inside what the wire carries: a reply the client cannot
decode is dropped there, and the HTTP request behind it would wait for the client's timeout."""
import pytest

from moebus.broker import admission
from moebus.broker.admission import detokenize, tokenize
from moebus.common import wire
from moebus.common.errors import RequestError
from moebus.common.model_config import load_config
from moebus.common.protocol import MAX_TOKENS_PER_PROMPT, Detokenize, DetokenizeReply, Tokenize, TokenizeReply
from moebus.common.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return TextTokenizer(tiny_model, load_config(tiny_model).eos_token_ids)


def test_the_longest_tokenize_reply_round_trips_the_wire():
    reply = TokenizeReply(id="t", tokens=[7] * MAX_TOKENS_PER_PROMPT, token_strs=["a"] * MAX_TOKENS_PER_PROMPT,
                          max_context=256)
    back = wire.decode(wire.encode(reply))
    assert len(back.tokens) == len(back.token_strs) == MAX_TOKENS_PER_PROMPT


def test_a_prompt_of_more_tokens_than_a_reply_carries_is_refused(tokenizer):
    text = "hello world " * (MAX_TOKENS_PER_PROMPT // 3)  # 4 tokens each: ~1.4 M tokens in 3 MiB
    with pytest.raises(RequestError) as err:
        tokenize(Tokenize(id="t", prompt=text), tokenizer, 256)
    assert err.value.http_status == 400 and err.value.param == "prompt" and err.value.code == "too_many_tokens"
    assert tokenize(Tokenize(id="t", prompt="hello world"), tokenizer, 256).tokens


def test_the_longest_detokenize_text_round_trips_the_wire():
    text = "\u00e9" * (admission.MAX_REPLY_TEXT_BYTES // 2)  # two bytes each
    assert wire.decode(wire.encode(DetokenizeReply(id="d" * 128, text=text))).text == text


def test_a_detokenized_text_beyond_the_reply_bound_is_refused(tokenizer, monkeypatch):
    ids = tokenizer.encode("hello world " * 50)
    text = detokenize(Detokenize(id="d", tokens=ids), tokenizer, 320).text
    # the tiny vocabulary's tokens are short: a lower bound stands in for a real model's long tokens
    monkeypatch.setattr(admission, "MAX_REPLY_TEXT_BYTES", len(text) - 1)
    with pytest.raises(RequestError) as err:
        detokenize(Detokenize(id="d", tokens=ids), tokenizer, 320)
    assert err.value.http_status == 400 and err.value.param == "tokens" and err.value.code == "too_many_tokens"
