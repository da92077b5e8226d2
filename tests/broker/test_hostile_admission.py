"""Admission's answers to TOKENIZE stay inside what the wire carries: a reply the client cannot
decode is dropped there, and the HTTP request behind it would wait for the client's timeout."""
import pytest

from moebus.broker.admission import tokenize
from moebus.common import wire
from moebus.common.errors import RequestError
from moebus.common.model_config import load_config
from moebus.common.protocol import MAX_TOKENS_PER_PROMPT, Tokenize, TokenizeReply
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
