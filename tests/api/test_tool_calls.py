"""Streamed tool calls, unit level: the parser fed a few characters at a time says what it says fed
the whole answer at once (fragments joined by the SDK's rules), a call's name goes out before its
arguments are written, its arguments go out in pieces as they come, and no markup reaches the
content; the chat formatter's chunks (n > 1, reasoning split) accumulated by the openai SDK's own
ChatCompletionStreamState give the whole answer's message."""
import json
import random

import pytest

from moebus.api.responses import ChatFormatter
from moebus.api.tool_calls import MORE, NOT_A_HEAD, ToolCallParser, call_head, merge_fragments
from moebus.common.protocol import Final, Partial

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
TRICKY = ('<tool_call>\n{"name": "note", "arguments": {"text": "a } and a { and \\" and \\\\",'
          ' "tags": ["x", {"y": []}],'
          ' "city": "Tromsø"}}\n</tool_call>')
SUM = '<tool_call>\n{"name": "sum", "parameters": {"a": 2, "b": 3}}\n</tool_call>'

CASES = {  # text: (content, [(name, arguments)])
    "one call": (WEATHER, "", [("get_weather", '{"city": "Oslo", "unit": "celsius"}')]),
    "content then two calls": ("Let me check.\n\n" + WEATHER + "\n" + SUM + "\n", "Let me check.",
                               [("get_weather", '{"city": "Oslo", "unit": "celsius"}'), ("sum", '{"a": 2, "b": 3}')]),
    "braces and quotes in strings": (TRICKY, "", [("note", json.dumps({
        "text": 'a } and a { and " and \\', "tags": ["x", {"y": []}], "city": "Tromsø"}, ensure_ascii=False))]),
    "other key order": ('<tool_call>{"arguments": {"q": 1}, "name": "find"}</tool_call>', "", [("find", '{"q": 1}')]),
    "string arguments": ('<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>', "", [("f", '{"q": 1}')]),
    "no arguments": ('<tool_call>\n{"name": "now"}\n</tool_call>', "", [("now", "{}")]),
    "not json": ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    "no name": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "cut off in the head": ('Hm <tool_call>\n{"name": "f", "argu', 'Hm <tool_call>\n{"name": "f", "argu', []),
    "cut off in the arguments": ('<tool_call>\n{"name": "f", "arguments": {"city": "Os', "", [("f", '{"city": "Os')]),
    "cut off in the close": ('<tool_call>{"name": "f", "arguments": {}}</tool_', "", [("f", "{}")]),
    "a tag in the content": ("x < y and <tool", "x < y and <tool", []),
    "content after a call": (WEATHER + "\n\nDone.  ", "Done.",
                             [("get_weather", '{"city": "Oslo", "unit": "celsius"}')]),
}


def _cuts(text: str, seed: int) -> list[str]:
    """The text in pieces of 1-4 characters."""
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        k = rng.randint(1, 4)
        pieces.append(text[i:i + k])
        i += k
    return pieces


def _run(pieces: list[str]) -> list[tuple[str, list[dict]]]:
    parser = ToolCallParser()
    return [parser.feed(p) for p in pieces] + [parser.finish()]


def _joined(outs) -> tuple[str, list[tuple[str, str]]]:
    calls = merge_fragments([f for _, fragments in outs for f in fragments])
    return "".join(c for c, _ in outs), [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("name", list(CASES))
def test_pieces_say_what_the_whole_text_says(name):
    text, content, calls = CASES[name]
    assert _joined(_run([text])) == (content, calls)
    for pieces in [list(text)] + [_cuts(text, seed) for seed in range(20)]:
        assert _joined(_run(pieces)) == (content, calls), pieces


@pytest.mark.parametrize("seed", range(5))
def test_a_call_streams_as_it_is_written(seed):
    text = "Let me check.\n" + WEATHER + "\n" + SUM
    pieces = _cuts(text, seed)
    outs = _run(pieces)
    fragments = [(k, f) for k, (_, fs) in enumerate(outs) for f in fs]
    firsts = [(k, f) for k, f in fragments if "id" in f]
    assert [f["index"] for _, f in firsts] == [0, 1]
    for _, f in firsts:  # the first fragment: index, id, type and name; arguments start empty
        assert f["type"] == "function" and f["id"].startswith("call_") and f["function"]["arguments"] == ""
    first_weather = firsts[0][0]
    fed = "".join(pieces[:first_weather + 1])
    assert '"Oslo"' not in fed  # the name went out before the arguments were written
    later = [f for _, f in fragments if "id" not in f and f["index"] == 0]
    assert len(later) > 3 and all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"}
                                  for f in later)  # arguments in pieces, nothing said twice
    assert all("<" not in c and ">" not in c for c, _ in outs)  # no markup in the content
    args_pieces = [k for k, f in fragments if "id" not in f and f["index"] == 0]
    closed_at = next(k for k in range(len(pieces)) if "".join(pieces[:k + 1]).count("</tool_call>") == 1)
    assert min(args_pieces) < closed_at  # arguments went out before the block closed


@pytest.mark.parametrize("body, head", [
    ('{"name": "f", "arguments": {', "f"),
    (' \n{ "name" : "a\\"b" ,\n "parameters":{"x"', 'a"b'),
    ('{"name": "f", "argu', MORE),
    ('{"name": "f', MORE),
    ("", MORE),
    ('{"arguments": {}', NOT_A_HEAD),
    ('{"name": "", "arguments": {', NOT_A_HEAD),
    ('{"name": "f", "arguments": "', NOT_A_HEAD),
    ('{"name": 3', NOT_A_HEAD),
])
def test_call_head(body, head):
    """A name: the head is complete, and the arguments begin at the last ``{``."""
    want = head if head in (MORE, NOT_A_HEAD) else (head, body.rindex("{"))
    assert call_head(body) == want


def _partials(text: str, seed: int, opens) -> list[Partial]:
    parts = [Partial(id="r", tokens=[1], text=p, logprobs=[0.0]) for p in _cuts(text, seed)]
    parts[0].reasoning_open = opens
    return parts


@pytest.mark.parametrize("seed", range(4))
def test_the_sdk_accumulates_the_stream_into_the_whole_answer(seed):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    texts = ["<think>\nweather first\n</think>\n\nLet me look.\n" + WEATHER + "\n" + SUM,
             "<think>\nno tools\n</think>\n\nIt is 4."]
    final = Final(id="r", finish_reason="stop", prompt_tokens=3, completion_tokens=9)
    whole = ChatFormatter("m", n=2, parse_tools=True).body([(_partials(t, seed, False), final) for t in texts])
    streaming = ChatFormatter("m", n=2, parse_tools=True)
    chunks = streaming.first_chunks()
    for i, text in enumerate(texts):  # choices interleave in the api; each has its own state either way
        chunks += [c for p in _partials(text, seed + i, False) if (c := streaming.chunk(i, p))]
        chunks.append(streaming.last_chunk(i, final))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    got = state.get_final_completion()
    for choice, want in zip(got.choices, whole["choices"]):
        message = want["message"]
        assert choice.finish_reason == want["finish_reason"]
        assert choice.message.content == message["content"]
        assert choice.message.model_extra["reasoning_content"] == message["reasoning_content"]
        calls = [(c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert calls == [(c["type"], c["function"]["name"], c["function"]["arguments"])
                         for c in message.get("tool_calls", [])]
        ids = [c.id for c in choice.message.tool_calls or []]  # each sent once, so not run together
        assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == len(ids)
    assert whole["choices"][0]["message"]["content"] == "Let me look."
    assert [c["function"]["name"] for c in whole["choices"][0]["message"]["tool_calls"]] == ["get_weather", "sum"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls" and whole["choices"][1]["finish_reason"] == "stop"
