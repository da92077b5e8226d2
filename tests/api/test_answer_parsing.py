"""The reasoning split and the tool-call parse of a chat answer, whole and cut into stream pieces at
every place (a tag split across two pieces included), through the formatter that the api uses."""
import json
import random

import pytest

from moebus.api.reasoning import ReasoningSplitter
from moebus.api.responses import ChatFormatter
from moebus.api.tool_calls import ToolCallParser, merge_fragments
from moebus.common.protocol import Final, Partial

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "sum", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _split(text: str, opens: bool, pieces) -> tuple[str, str]:
    splitter = ReasoningSplitter(opens)
    out = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("text, opens, reasoning, content", [
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", False, "Let me see.", "It is 4."),
    ("Let me see.\n</think>\n\nIt is 4.", True, "Let me see.", "It is 4."),  # the prompt opened the block
    ("\n<think>\n\n</think>\n\nIt is 4.", False, "", "It is 4."),
    ("It is 4.", False, "", "It is 4."),
    ("It is <think> 4.", False, "", "It is <think> 4."),  # a tag inside the content is content
    ("still thinking when the length ran out\n", True, "still thinking when the length ran out\n", ""),
    ("a\n\nb\n</think>c</think>", True, "a\n\nb", "c</think>"),
    ("<thin", False, "", "<thin"),
])
def test_reasoning_split(text, opens, reasoning, content):
    assert _split(text, opens, [text]) == (reasoning, content)
    for seed in range(30):
        assert _split(text, opens, _pieces(text, seed)) == (reasoning, content)
    assert _split(text, opens, list(text)) == (reasoning, content)


def _parse(text: str, pieces) -> tuple[str, list[dict]]:
    parser = ToolCallParser()
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(c for c, _ in outs), merge_fragments([f for _, fragments in outs for f in fragments])


@pytest.mark.parametrize("text, content, names", [
    (CALL, "", ["get_weather"]),
    ("Checking.\n" + CALL + "\n" + CALL2 + "\n", "Checking.", ["get_weather", "sum"]),
    ("No tools needed: 4.", "No tools needed: 4.", []),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ('<tool_call>\n{"name": "f", "arg', '<tool_call>\n{"name": "f", "arg', []),  # cut off by the length
    ("x < y and <tool", "x < y and <tool", []),
])
def test_tool_call_parse(text, content, names):
    for pieces in [[text], list(text)] + [_pieces(text, seed) for seed in range(30)]:
        got_content, calls = _parse(text, pieces)
        assert got_content == content
        assert [c["function"]["name"] for c in calls] == names
    if names:
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
        assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def _partials(text: str, opens, seed: int) -> list[Partial]:
    parts = [Partial(id="r", tokens=[1], text=p, logprobs=[0.0]) for p in _pieces(text, seed)]
    parts[0].reasoning_open = opens
    return parts


@pytest.mark.parametrize("seed", range(5))
def test_formatter_whole_and_streamed_agree(seed):
    text = "<think>\nweather first\n</think>\n\nLet me look." + "\n" + CALL + "\n" + CALL2
    final = Final(id="r", finish_reason="stop", prompt_tokens=3, completion_tokens=9)
    whole = ChatFormatter("m", parse_tools=True).body([(_partials(text, False, seed), final)])
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "weather first" and message["content"] == "Let me look."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "sum"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"

    streaming = ChatFormatter("m", parse_tools=True)
    chunks = [streaming.chunk(0, p) for p in _partials(text, False, seed)] + [streaming.last_chunk(0, final)]
    deltas = [c["choices"][0]["delta"] for c in chunks if c is not None]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "weather first"
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."
    calls = [call for d in deltas for call in d.get("tool_calls", []) if "id" in call]  # each call's first
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "sum")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_or_reasoning_the_text_is_content():
    text = "<think>x</think>" + CALL
    final = Final(id="r", finish_reason="stop", prompt_tokens=3, completion_tokens=9)
    message = ChatFormatter("m").body([(_partials(text, None, 0), final)])["choices"][0]["message"]
    assert message == {"role": "assistant", "content": text}
