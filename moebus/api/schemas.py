"""Request bodies, validated with pydantic. Unknown fields are tolerated (OpenAI clients send many);
a known field of the wrong type or out of range is a 400 naming it. Fields beyond OpenAI's follow
vLLM's names (``top_k``, ``ignore_eos``, ``stop_token_ids``), sent by the SDK through ``extra_body``."""
from __future__ import annotations

import json
from typing import Annotated, Any

from flask import request
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moebus.common.errors import RequestError
from moebus.common.protocol import MAX_GPUS, MAX_INT32, MAX_RESERVE_MIB, MAX_STOP_CHARS, MAX_STOP_STRINGS

MAX_LOGPROBS = 20
CONTENT_PART_TYPES = ("text", "image_url")


def parse_body(model: type[BaseModel]):
    """The request's JSON body as ``model``; raises RequestError (400) for anything else."""
    raw = request.get_data(cache=True)  # raises RequestEntityTooLarge (413) past api.max_body_bytes
    try:
        body = json.loads(raw) if raw else None
        # JSON may spell lone surrogates (\\ud800), which are not Unicode: no tokenizer or codec takes them
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("the request body holds a string that is not valid Unicode (a lone surrogate)",
                           code="invalid_unicode") from None
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    return model.model_validate(body)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """What chat and text completions share: sampling, stop rules, streaming."""

    model: str | None = None  # one model is served; any name is answered by it
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # -1 or 0: off (vLLM uses -1); > vocabulary: off
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | None = Field(None, max_length=MAX_STOP_STRINGS)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n != 1:
            raise RequestError(f"n={n}: only n=1 is supported", param="n")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        if any(s == "" for s in stops):
            raise RequestError("stop strings must not be empty", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise RequestError(f"stop strings are at most {MAX_STOP_CHARS} characters", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int | None, logprobs: int) -> dict:
        """Keyword arguments for ``Client.generate`` (fields of protocol.Sampling)."""
        fields = {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                  "stop": self.stop or None, "top_k": max(self.top_k, 0) if self.top_k is not None else None,
                  "ignore_eos": self.ignore_eos or None, "stop_token_ids": self.stop_token_ids, "logprobs": logprobs}
        return {k: v for k, v in fields.items() if v is not None}


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def to_broker(self) -> dict:
        """The message as the chat template sees it (extra fields such as ``name`` included)."""
        message = self.model_dump()
        if message["content"] is None:  # e.g. an assistant turn that only called tools
            message["content"] = ""
        return message


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check(self):
        for n, message in enumerate(self.messages):
            for k, part in enumerate(message.content if isinstance(message.content, list) else []):
                _check_part(part, f"messages.{n}.content.{k}")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    @property
    def top_n(self) -> int | None:
        """Top logprobs per token to answer, None: no logprobs at all."""
        return (self.top_logprobs or 0) if self.logprobs else None


def _check_part(part: dict, where: str) -> None:
    kind = part.get("type")
    if kind not in CONTENT_PART_TYPES:
        raise RequestError(f"{where}: unknown content part type {kind!r} (expected one of "
                           f"{', '.join(CONTENT_PART_TYPES)})", param=f"{where}.type")
    if kind == "text" and not isinstance(part.get("text"), str):
        raise RequestError(f"{where}: a text part needs a string 'text'", param=f"{where}.text")
    image = part.get("image_url")
    has_url = isinstance(image, str) or isinstance(image, dict) and isinstance(image.get("url"), str)
    if kind == "image_url" and not has_url:
        raise RequestError(f"{where}: an image_url part needs 'image_url': {{'url': ...}}", param=f"{where}.image_url")


class CompletionRequest(_Generation):
    prompt: Any = Field(...)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if any(t < 0 or t > MAX_INT32 for t in prompt):
                raise RequestError(f"token ids must be in [0, {MAX_INT32}]", param="prompt")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise RequestError("a batch of prompts is not supported: send one request per prompt", param="prompt")
        raise RequestError("prompt must be a string or a non-empty list of token ids", param="prompt")

    @model_validator(mode="after")
    def _unsupported(self):
        if self.echo:
            raise RequestError("echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise RequestError("best_of > 1 is not supported", param="best_of")
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        return self

    def prompt_kwargs(self) -> dict:
        return {"prompt": self.prompt} if isinstance(self.prompt, str) else {"prompt_tokens": self.prompt}


Reserve = Annotated[float, Field(ge=0.0, le=MAX_RESERVE_MIB)]


class VramRequest(_Body):
    """``reserve_mib``: MiB to leave free per GPU in worker order (one number: GPU 0); absent or null:
    back to the start-up sizes (a bare VRAM). ``query``: report only."""

    reserve_mib: Annotated[list[Reserve], Field(max_length=MAX_GPUS)] | Reserve | None = None
    query: bool = False

    @property
    def reserves(self) -> list[float] | None:
        value = self.reserve_mib
        return [value] if isinstance(value, float | int) else value

