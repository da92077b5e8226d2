"""OpenAI response objects built from the broker's Partials and Final: chat completions and legacy
text completions, whole or as stream chunks, with usage and logprobs in each API's own shape."""
from __future__ import annotations

import time
import uuid

from moebus.common.protocol import Final, Partial


def usage(final: Final) -> dict:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens}


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

    def __init__(self, model: str, top_n: int | None = None, include_usage: bool = False):
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.top_n = top_n
        self.include_usage = include_usage

    def _envelope(self, object_name: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _chunk(self, choice: dict) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope(self.chunk_object_name, [{"index": 0, **choice}], **extra)

    def usage_chunk(self, final: Final) -> dict:
        return {**self._chunk({}), "choices": [], "usage": usage(final)}


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def _logprobs(self, parts: list[Partial]) -> dict | None:
        if self.top_n is None:
            return None
        return {"content": [_chat_token(text, lp, top)
                            for part in parts for text, lp, top in _tokens(part, self.top_n)]}

    def body(self, parts: list[Partial], final: Final) -> dict:
        message = {"role": "assistant", "content": "".join(p.text for p in parts)}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(parts),
                  "finish_reason": final.finish_reason}
        return self._envelope(self.object_name, [choice], usage=usage(final))

    def first_chunk(self) -> dict:
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})

    def chunk(self, part: Partial) -> dict | None:
        if not part.text and self.top_n is None:
            return None  # text held back (a possible stop string) and nothing else to say
        return self._chunk({"delta": {"content": part.text}, "logprobs": self._logprobs([part]), "finish_reason": None})

    def last_chunk(self, final: Final) -> dict:
        return self._chunk({"delta": {}, "logprobs": None, "finish_reason": final.finish_reason})


def _chat_token(text: str, logprob: float, top: list) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]}


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_offset = 0  # text_offset runs on across stream chunks

    def _logprobs(self, parts: list[Partial]) -> dict | None:
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
                out["text_offset"].append(self.text_offset)
                self.text_offset += len(text)
        return out

    def body(self, parts: list[Partial], final: Final) -> dict:
        choice = {"index": 0, "text": "".join(p.text for p in parts), "logprobs": self._logprobs(parts),
                  "finish_reason": final.finish_reason}
        return self._envelope(self.object_name, [choice], usage=usage(final))

    def first_chunk(self) -> None:
        return None

    def chunk(self, part: Partial) -> dict | None:
        if not part.text and self.top_n is None:
            return None
        return self._chunk({"text": part.text, "logprobs": self._logprobs([part]), "finish_reason": None})

    def last_chunk(self, final: Final) -> dict:
        return self._chunk({"text": "", "logprobs": None, "finish_reason": final.finish_reason})
