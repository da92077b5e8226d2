"""Tool calls parsed from a chat answer in the Hermes / Qwen format that their chat templates teach
the model: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call.

Calls stream as vLLM and OpenAI stream them: a call's first fragment carries its ``index``, ``id``,
``type`` and ``function.name``, later fragments ``function.arguments`` pieces as the model writes
them. A block that begins ``{"name": "<name>", "arguments": {`` is a call from then on (a stream
cannot take back what it sent): its arguments are the text the model wrote for that object, the
rest of the block up to ``</tool_call>`` is markup. Any other block is held until it closes and is
a call when its body is such a JSON object in another shape (one fragment), else content as
written, as is a block that was cut off before its head. Whitespace around calls is dropped; other
content is kept. Text that may begin a tag is held back until the next piece says what it is;
whole answers go through the same parser, so a stream and a whole answer always agree."""
from __future__ import annotations

import json
import uuid

from moebus.api.reasoning import safe_length

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ('"arguments"', '"parameters"')
MORE, NOT_A_HEAD = "more", "not a head"  # what call_head says of a body that has no head (yet)
_WS = " \t\r\n"
_NAME, _KEY = object(), object()  # call_head's steps that are not literals
_HEAD = ("{", '"name"', ":", _NAME, ",", _KEY, ":", "{")


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of a whole block's body, None when it is not a call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return call["name"], arguments


def _string_end(text: str, start: int) -> int | None:
    """The index after the JSON string opening at ``text[start]``; None when it has not ended."""
    escaped = False
    for i in range(start + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return None


def call_head(body: str) -> tuple[str, int] | str:
    """(name, index of the arguments' ``{``) once ``body`` begins ``{"name": "...", "arguments": {``;
    MORE while it may still; NOT_A_HEAD when it cannot."""
    i, name = 0, ""
    for step in _HEAD:
        while i < len(body) and body[i] in _WS:
            i += 1
        rest = body[i:]
        if step is _NAME:
            if not rest.startswith('"'):
                return MORE if not rest else NOT_A_HEAD
            end = _string_end(body, i)
            if end is None:
                return MORE
            try:
                name = json.loads(body[i:end])
            except ValueError:
                return NOT_A_HEAD
            if not name:
                return NOT_A_HEAD
            i = end
            continue
        options = ARGUMENT_KEYS if step is _KEY else (step,)
        hit = next((o for o in options if rest.startswith(o)), None)
        if hit is None:
            return MORE if any(o.startswith(rest) for o in options) else NOT_A_HEAD
        i += len(hit)
    return name, i - 1


class _ObjectEnd:
    """Follows a JSON object's text piece by piece to tell where it ends (braces in strings do not count)."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = self.ended = False

    def take(self, text: str) -> int:
        """How much of ``text`` belongs to the object: all of it until the object closes."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.ended = True
                    return i + 1
        return len(text)


def merge_fragments(fragments: list[dict]) -> list[dict]:
    """Fragments of the same call (by ``index``) joined into one, in order: whole calls from a whole
    answer's fragments, or one entry per call in a stream chunk."""
    merged: dict[int, dict] = {}
    for fragment in fragments:
        call = merged.get(fragment["index"])
        if call is None:
            merged[fragment["index"]] = {**fragment, "function": dict(fragment["function"])}
        else:
            call["function"]["arguments"] = call["function"].get("arguments", "") + fragment["function"]["arguments"]
    return list(merged.values())


class ToolCallParser:
    """``feed`` content pieces, get ``(content, [call fragments])``; ``finish`` flushes what is held.
    States: outside a block; in a block's head; in a block that is held whole; in a call's
    arguments; in the markup after them."""

    def __init__(self):
        self.pending = ""
        self.state = "content"
        self.num_calls = 0
        self.arguments: _ObjectEnd | None = None
        self.held_space = ""  # whitespace that is content only if more content follows
        self.after_call = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, fragments = [], []
        while self._step(content, fragments):
            pass
        return "".join(content), fragments

    def _step(self, content: list[str], fragments: list[dict]) -> bool:
        """One move of the state machine; False when it must wait for more text."""
        if self.state == "content":
            start = self.pending.find(CALL_OPEN)
            if start < 0:
                cut = safe_length(self.pending, CALL_OPEN)
                content.append(self._content(self.pending[:cut]))
                self.pending = self.pending[cut:]
                return False
            content.append(self._content(self.pending[:start]))
            self.pending, self.state = self.pending[start + len(CALL_OPEN):], "head"
            return True
        end = self.pending.find(CALL_CLOSE)
        if self.state in ("arguments", "markup"):
            return self._in_call(end, fragments)
        if self.state == "head":
            head = call_head(self.pending if end < 0 else self.pending[:end])
            if isinstance(head, tuple):
                name, brace = head
                fragments.append(self._first_fragment(name, ""))
                self.pending, self.state, self.arguments = self.pending[brace:], "arguments", _ObjectEnd()
                return True
            if head == NOT_A_HEAD:
                self.state = "whole"
        if end < 0:
            return False
        body, self.pending, self.state = self.pending[:end], self.pending[end + len(CALL_CLOSE):], "content"
        call = parse_call(body.strip())
        if call is None:
            content.append(self._content(CALL_OPEN + body + CALL_CLOSE))
        else:
            fragments.append(self._first_fragment(*call))
            self._call_ended()
        return True

    def _in_call(self, end: int, fragments: list[dict]) -> bool:
        """A call's arguments stream as they come; the markup after them up to the close is dropped."""
        region = self.pending[:end] if end >= 0 else self.pending[: safe_length(self.pending, CALL_CLOSE)]
        self._arguments(region, fragments)
        self.pending = self.pending[len(region):]
        if end < 0:
            return False
        self.pending, self.state = self.pending[len(CALL_CLOSE):], "content"
        self._call_ended()
        return True

    def _arguments(self, text: str, fragments: list[dict]) -> None:
        if self.state != "arguments":
            return
        taken = self.arguments.take(text)
        if taken:
            fragments.append({"index": self.num_calls - 1, "function": {"arguments": text[:taken]}})
        if self.arguments.ended:
            self.state = "markup"

    def _first_fragment(self, name: str, arguments: str) -> dict:
        self.num_calls += 1
        self.held_space = ""  # the whitespace before a call is not content (kept for a block that is)
        return {"index": self.num_calls - 1, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def _call_ended(self) -> None:
        self.held_space, self.after_call = "", True

    def _content(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body):]
        return body

    def finish(self) -> tuple[str, list[dict]]:
        """Held text at the end: a call cut off keeps the arguments written so far (the finish reason
        says ``length``); a block cut off before its head is content as written; trailing
        whitespace is content only when the answer called no tool."""
        fragments = []
        if self.state in ("arguments", "markup"):
            self._arguments(self.pending, fragments)
            out = ""
        else:
            out = self._content((CALL_OPEN + self.pending) if self.state != "content" else self.pending)
        self.pending, self.state = "", "content"
        if not self.num_calls:
            out += self.held_space
        self.held_space = ""
        return out, fragments
