import json

import pytest

from moebus.common.errors import RequestError
from moebus.common.tokenizer import StreamDecoder, TextTokenizer


def test_encode_decode_chat_template_and_stop_ids(tiny_model):
    tok = TextTokenizer(tiny_model)
    ids = tok.encode("the expert cache")
    assert tok.decode(ids) == "the expert cache"
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    parts = tok.render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert "ab<|im_end|>" in parts
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    assert im_end in tok.stop_ids
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == tok.tokenizer.token_to_id("<|im_start|>")


def test_directory_without_chat_template_serves_text(tmp_path, tiny_model):
    for f in ("tokenizer.json", "config.json"):
        (tmp_path / f).write_bytes((tiny_model / f).read_bytes())
    cfg = json.loads((tiny_model / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = TextTokenizer(tmp_path)
    assert tok.encode("hello")
    with pytest.raises(RequestError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_stream_decoder_emits_whole_characters(tiny_model):
    tok = TextTokenizer(tiny_model)
    ids = tok.encode("naïve café ✓ done")
    dec = StreamDecoder(tok)
    text = "".join(dec.push(i) for i in ids)
    assert text == "naïve café ✓ done"
    assert "\ufffd" not in text


class CountingTokenizer(TextTokenizer):
    """The real tokenizer, noting how many ids each decode call is given."""

    def __init__(self, *args):
        super().__init__(*args)
        self.decoded_ids: list[int] = []

    def decode(self, ids) -> str:
        self.decoded_ids.append(len(ids))
        return super().decode(ids)


def test_stream_decoding_costs_new_tokens_not_the_whole_sequence(tiny_model):
    tok = CountingTokenizer(tiny_model)
    ids = tok.encode("naïve café ✓ done, and then some more words to stream. " * 40)
    dec = StreamDecoder(tok)
    text = "".join(dec.push(i) for i in ids) + dec.flush()
    widest = max(tok.decoded_ids)
    assert text == tok.decode(ids)
    assert len(ids) > 500 and widest <= 8  # a window of a few tokens, however long the stream


def test_stream_decoder_matches_a_whole_decode_for_random_ids(tiny_model):
    import numpy as np

    tok = TextTokenizer(tiny_model)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, tok.vocab_size, 40).tolist()
        dec = StreamDecoder(tok)
        text = "".join(dec.push(i) for i in ids) + dec.flush()
        assert text == tok.decode(ids)
