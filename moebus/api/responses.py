"""OpenAI response objects built from the broker's Partials and Finals: chat completions and legacy
text completions, whole or as stream chunks, with usage and logprobs in each API's own shape. A
request with ``n`` choices is n broker requests; choice i is built from request i's messages. A
chat answer is split into reasoning, content and tool calls (reasoning.py, tool_calls.py); whole
answers run through the same per-choice state as streams, so both always say the same."""
from __future__ import annotations

import time
import uuid

from moebus.api.reasoning import ReasoningSplitter
from moebus.api.tool_calls import ToolCallParser, merge_fragments
from moebus.common.protocol import Final, Partial


def usage(finals: list[Final]) -> dict:
    """The prompt counts once (every choice reads the same prompt); completions add up."""
    prompt = finals[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _tokens(part: Partial, top_n: int):
    """(text, logprob, [(top text, top logprob)...]) per token of a Partial asked with logprobs."""
    tops = part.top_logprobs or [[] for _ in part.tokens]
    top_texts = part.top_texts or [[] for _ in part.tokens]
    texts = part.token_texts or ["" for _ in part.tokens]
    for text, logprob, top, names in zip(texts, part.logprobs, tops, top_texts):
        yield text, logprob, [(name, lp) for name, (_, lp) in zip(names[:top_n], top[:top_n])]


class Formatter:
    """One request's answer. ``top_n`` None: no logprobs; else top logprobs per token (0: none)."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, top_n: int | None = None, include_usage: bool = False, n: int = 1):
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.top_n = top_n
        self.include_usage = include_usage
        self.n = n

    def request_id(self, index: int) -> str:
        """The broker request id of choice ``index``."""
        return self.id if self.n == 1 else f"{self.id}-{index}"

    def _envelope(self, object_name: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _chunk(self, index: int, choice: dict) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope(self.chunk_object_name, [{"index": index, **choice}], **extra)

    def usage_chunk(self, finals: list[Final]) -> dict:
        return {**self._chunk(0, {}), "choices": [], "usage": usage(finals)}

    def body(self, results: list[tuple[list[Partial], Final]]) -> dict:
        """The whole answer: per choice its Partials and its Final."""
        choices = [self._choice(i, parts, final) for i, (parts, final) in enumerate(results)]
        return self._envelope(self.object_name, choices, usage=usage([final for _, final in results]))

    def first_chunks(self) -> list[dict]:
        return []


class _ChatChoice:
    """Where one choice's text stands: its reasoning split and tool-call parse."""

    def __init__(self, parse_tools: bool):
        self.splitter: ReasoningSplitter | None = None
        self.tools = ToolCallParser() if parse_tools else None
        self.started = False

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, part: Partial) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool-call fragments) of one Partial."""
        if not self.started:  # the first Partial says whether the model writes reasoning blocks
            self.started = True
            if part.reasoning_open is not None:
                self.splitter = ReasoningSplitter(part.reasoning_open)
        reasoning, content = self.splitter.feed(part.text) if self.splitter else ("", part.text)
        return (reasoning, *self._calls(content))

    def finish(self) -> tuple[str, str, list[dict]]:
        reasoning, content = self.splitter.finish() if self.splitter else ("", "")
        content, fragments = self._calls(content)
        if self.tools is not None:
            rest, more = self.tools.finish()
            content, fragments = content + rest, fragments + more
        return reasoning, content, fragments

    def _calls(self, content: str) -> tuple[str, list[dict]]:
        if self.tools is None:
            return content, []
        return self.tools.feed(content)


def _finish_reason(final: Final, num_calls: int) -> str:
    return "tool_calls" if num_calls and final.finish_reason == "stop" else final.finish_reason


def _delta(reasoning: str, content: str, fragments: list[dict]) -> dict:
    delta = {"reasoning_content": reasoning} if reasoning else {}
    if content:
        delta["content"] = content
    if fragments:  # one entry per call in a chunk, as OpenAI sends them
        delta["tool_calls"] = merge_fragments(fragments)
    return delta


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, top_n: int | None = None, include_usage: bool = False, n: int = 1,
                 parse_tools: bool = False):
        super().__init__(model, top_n, include_usage, n)
        self.states = [_ChatChoice(parse_tools) for _ in range(n)]

    def _logprobs(self, parts: list[Partial]) -> dict | None:
        if self.top_n is None:
            return None
        return {"content": [_chat_token(text, lp, top)
                            for part in parts for text, lp, top in _tokens(part, self.top_n)]}

    def _choice(self, index: int, parts: list[Partial], final: Final) -> dict:
        state = self.states[index]
        pieces = [state.feed(p) for p in parts] + [state.finish()]
        reasoning = "".join(r for r, _, _ in pieces)
        content = "".join(c for _, c, _ in pieces)
        calls = [{k: v for k, v in call.items() if k != "index"}
                 for call in merge_fragments([f for _, _, fragments in pieces for f in fragments])]
        # no content: null when the answer was all reasoning or calls (as vLLM), else the empty string
        message = {"role": "assistant", "content": content if content or not (calls or reasoning) else None}
        if state.splitter is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "logprobs": self._logprobs(parts),
                "finish_reason": _finish_reason(final, len(calls))}

    def first_chunks(self) -> list[dict]:
        return [self._chunk(i, {"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}) for i in range(self.n)]

    def chunk(self, index: int, part: Partial) -> dict | None:
        delta = _delta(*self.states[index].feed(part))
        if not delta and self.top_n is None:
            return None  # text held back (a possible stop string or tag) and nothing else to say
        return self._chunk(index, {"delta": delta or {"content": ""}, "logprobs": self._logprobs([part]),
                                   "finish_reason": None})

    def last_chunk(self, index: int, final: Final) -> dict:
        state = self.states[index]
        delta = _delta(*state.finish())
        return self._chunk(index, {"delta": delta, "logprobs": None,
                                   "finish_reason": _finish_reason(final, state.num_calls)})


def _chat_token(text: str, logprob: float, top: list) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]}


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_offsets = [0] * self.n  # text_offset runs on across stream chunks

    def _logprobs(self, index: int, parts: list[Partial]) -> dict | None:
        """The legacy shape: the top dict holds the top_n most likely tokens and the chosen one."""
        if self.top_n is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for part in parts:
            for text, logprob, top in _tokens(part, self.top_n):
                out["tokens"].append(text)
                out["token_logprobs"].append(logprob)
                by_text = {}  # tokens that read alike (pieces of characters) keep the likeliest
                for name, lp in top + [(text, logprob)]:
                    by_text.setdefault(name, lp)
                out["top_logprobs"].append(by_text)
                out["text_offset"].append(self.text_offsets[index])
                self.text_offsets[index] += len(text)
        return out

    def _choice(self, index: int, parts: list[Partial], final: Final) -> dict:
        return {"index": index, "text": "".join(p.text for p in parts), "logprobs": self._logprobs(index, parts),
                "finish_reason": final.finish_reason}

    def chunk(self, index: int, part: Partial) -> dict | None:
        if not part.text and self.top_n is None:
            return None
        return self._chunk(index, {"text": part.text, "logprobs": self._logprobs(index, [part]), "finish_reason": None})

    def last_chunk(self, index: int, final: Final) -> dict:
        return self._chunk(index, {"text": "", "logprobs": None, "finish_reason": final.finish_reason})
