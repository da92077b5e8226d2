"""Splitting a chat answer into ``reasoning_content`` and ``content`` for models whose template uses
``<think>...</think>`` blocks (Qwen3, DeepSeek-R1 and their kind), as vLLM's reasoning parsers do.

The answer begins as reasoning when the prompt ended inside an open ``<think>`` (the broker tells:
``Partial.reasoning_open``), or when the answer itself opens with ``<think>``; the first ``</think>``
ends it. The newlines that the templates put around a block's text are dropped. Text arrives in
pieces, so a tail that may still become a tag is held back until the next piece says what it is;
whole answers go through the same splitter, so a stream and a whole answer always agree."""
from __future__ import annotations

from moebus.common.tokenizer import THINK_CLOSE, THINK_OPEN


def safe_length(text: str, tag: str) -> int:
    """How much of ``text`` can go out now: all but a tail that is the beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)


class ReasoningSplitter:
    """``feed`` text pieces, get ``(reasoning, content)`` pieces; ``finish`` flushes what is held."""

    def __init__(self, starts_in_reasoning: bool):
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.pending = ""
        self.reasoning_started = False  # leading newlines of a block are dropped
        self.after_block = False  # ... and those between the block and the content

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self.pending, self.state = head[len(THINK_OPEN):], "reasoning"
                elif THINK_OPEN.startswith(head):
                    break  # still may become <think>
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                reasoning.append(self._reasoning())
                if self.state == "reasoning":
                    break
            else:
                content.append(self._content(self.pending))
                self.pending = ""
        return "".join(reasoning), "".join(content)

    def _reasoning(self) -> str:
        end = self.pending.find(THINK_CLOSE)
        if end >= 0:
            text, self.pending = self.pending[:end].rstrip("\n"), self.pending[end + len(THINK_CLOSE):]
            self.state, self.after_block = "content", True
        else:  # hold back a tail that may begin </think>, and trailing newlines that may precede it
            text = self.pending[: safe_length(self.pending, THINK_CLOSE)].rstrip("\n")
            self.pending = self.pending[len(text):]
        if not self.reasoning_started:
            text = text.lstrip("\n")
            self.reasoning_started = bool(text)
        return text

    def _content(self, text: str) -> str:
        if self.after_block:
            text = text.lstrip("\n")
            self.after_block = not text
        return text

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the answer: an unclosed block's text is reasoning."""
        text, self.pending = self.pending, ""
        if self.state == "reasoning":
            return (text if self.reasoning_started else text.lstrip("\n")), ""
        return "", self._content(text)
