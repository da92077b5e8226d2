"""The scripted tiny model's cutting of its text into tokens (tests/api/test_tool_calls_served.py
serves one and checks with transformers that greedy decoding writes its text)."""
import pytest

from moebus.common.tiny_script import add_script_tokens, script_pieces
from moebus.common.tiny_tokenizer import train_tokenizer


@pytest.mark.parametrize("text", ['{"a": "a", "a": "a"}', "aaaaaaaaaaaaaaaaaaaaaa", "x", "the the the the"])
def test_pieces_are_the_text_and_all_new(text):
    taken = {"the", " the", "a"}
    pieces = script_pieces(text, taken, piece_chars=3)
    assert "".join(pieces) == text and len(set(pieces)) == len(pieces) and not taken & set(pieces)


def test_a_script_that_does_not_fit_is_refused():
    tokenizer = train_tokenizer(320)
    with pytest.raises(ValueError, match="does not fit"):
        add_script_tokens(tokenizer, "".join(f"word{i} " for i in range(80)), vocab_size=384, hidden_size=64)
    ids = add_script_tokens(tokenizer, "a short answer", vocab_size=384, hidden_size=64, piece_chars=4)
    assert ids == list(range(320, 320 + len(ids))) and tokenizer.decode(ids) == "a short answer"
