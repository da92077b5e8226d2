"""Tool calls parsed from a chat answer in the Hermes / Qwen format that their chat templates teach
the model: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call.

A block whose body is not such a JSON object stays in the content as it was written. Whitespace
between calls and around them is dropped; other content is kept. Text arrives in pieces, so a tail
that may begin a block, and a block until it closes, is held back; whole answers go through the
same parser, so a stream and a whole answer always agree."""
from __future__ import annotations

import json
import uuid

from moebus.api.reasoning import safe_length

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def parse_call(body: str) -> dict | None:
    """The OpenAI ``tool_calls`` entry for one block's body, None when it is not a call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": arguments}}


class ToolCallParser:
    """``feed`` content pieces, get ``(content, [new calls])``; ``finish`` flushes what is held."""

    def __init__(self):
        self.pending = ""
        self.inside = False
        self.calls: list[dict] = []
        self.held_space = ""  # whitespace that is content only if more content follows
        self.after_call = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, new = [], []
        while True:
            if self.inside:
                end = self.pending.find(CALL_CLOSE)
                if end < 0:
                    break
                body, self.pending = self.pending[:end], self.pending[end + len(CALL_CLOSE):]
                self.inside = False
                call = parse_call(body.strip())
                if call is None:
                    content.append(self._content(CALL_OPEN + body + CALL_CLOSE))
                else:
                    new.append(call)
                    self.held_space, self.after_call = "", True
                continue
            start = self.pending.find(CALL_OPEN)
            if start >= 0:
                content.append(self._content(self.pending[:start]))
                self.pending, self.inside, self.held_space = self.pending[start + len(CALL_OPEN):], True, ""
                continue
            cut = safe_length(self.pending, CALL_OPEN)
            content.append(self._content(self.pending[:cut]))
            self.pending = self.pending[cut:]
            break
        self.calls += new
        return "".join(content), new

    def _content(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body):]
        return body

    def finish(self) -> str:
        """Held text at the end: an unclosed block is content as written; trailing whitespace is
        content only when the answer called no tool."""
        text = (CALL_OPEN + self.pending) if self.inside else self.pending
        self.pending, self.inside = "", False
        out = self._content(text)
        if not self.calls:
            out += self.held_space
        self.held_space = ""
        return out
