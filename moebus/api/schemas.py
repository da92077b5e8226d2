"""Request bodies, validated with pydantic. Nothing is accepted and ignored: a field of the wrong
type or out of range, a field that OpenAI defines but moebus does not implement, and a field that
nobody defines are each a 400 naming it. Fields beyond OpenAI's follow vLLM's names (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``chat_template_kwargs``), sent
by the SDK through ``extra_body``. (Messages and tool definitions keep their extra keys: they are
the chat template's to read.)"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from flask import request
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moebus.api.structured import (check_tool_choice, guided_constraint, one_constraint, response_format_constraint,
                                   tools_constraint)
from moebus.common.errors import RequestError
from moebus.common.protocol import (MAX_ABS_LOGIT_BIAS, MAX_GPUS, MAX_INT32, MAX_LOGIT_BIAS, MAX_RESERVE_MIB,
                                    MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOOLS)

MAX_LOGPROBS = 20
MAX_CHOICES = 16  # n: each choice is one request to the broker
# OpenAI fields that moebus does not implement: refused unless they hold a value that asks for nothing
NOT_IMPLEMENTED = {"audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
                   "web_search_options": (None,), "reasoning_effort": (None,), "verbosity": (None,),
                   "moderation": (None,), "functions": (None,), "function_call": (None,), "store": (None, False),
                   "service_tier": (None, "auto", "default"), "parallel_tool_calls": (None, True)}
# other servers' grammar fields that moebus does not take (api/structured.py says which it does)
OTHER_GRAMMARS = {name: (None,) for name in ("guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
                                             "structured_outputs", "grammar", "json_schema")}
CONTENT_PART_TYPES = ("text", "image_url")
VIDEO_PART_TYPES = ("video", "video_url", "input_video")  # refused by name: a clear 400, not "unknown"


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
    _check_wire_ints(body)
    return model.model_validate(body)


MIN_WIRE_INT, MAX_WIRE_INT = -2 ** 63, 2 ** 64 - 1  # what msgpack carries to the broker
TYPED_LISTS = ("prompt", "tokens")  # their schemas bound every id: no need to walk a million of them


def _check_wire_ints(body: dict) -> None:
    """Free-form parts (message extras, tool schemas, chat_template_kwargs) reach the broker as
    msgpack, which has no integers beyond 64 bits: refuse one here, naming where it is (it was a
    500 when the client could not encode the message). Iterative: bodies may nest ~1000 deep."""
    todo = [((key,), value) for key, value in body.items() if key not in TYPED_LISTS]
    while todo:
        where, value = todo.pop()
        if isinstance(value, dict):
            todo += [(where + (k,), v) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(where + (i,), v) for i, v in enumerate(value)]
        elif type(value) is int and not MIN_WIRE_INT <= value <= MAX_WIRE_INT:
            param = ".".join(str(p) for p in where)
            raise RequestError(f"{param}: integers must lie in [-2**63, 2**64)", param=param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    include_obfuscation: bool = False

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value):
        if value:
            raise RequestError("stream_options.include_obfuscation is not supported",
                               param="stream_options.include_obfuscation", code="not_supported")
        return value


def refuse_unknown(body: BaseModel, not_implemented: dict) -> None:
    """400 for the first extra field: not implemented (unless it asks for nothing) or unknown."""
    for name, value in (body.model_extra or {}).items():
        if name not in not_implemented:
            raise RequestError(f"unknown field {name!r}", param=name, code="unknown_field")
        if not any(value == allowed and type(value) is type(allowed) for allowed in not_implemented[name]):
            raise RequestError(f"{name} is not supported by this server", param=name, code="not_supported")


class _Generation(_Body):
    """What chat and text completions share: sampling, stop rules, streaming."""

    model: str | None = None  # one model is served; any name is answered by it
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # -1 or 0: off (vLLM uses -1); > vocabulary: off
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | None = Field(None, max_length=MAX_STOP_STRINGS)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)  # vLLM's extension
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's extension
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None  # OpenAI's end-user id for abuse tracking: no effect on the answer
    # structured outputs (api/structured.py): OpenAI's response_format, vLLM's guided_* extensions
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, bias):
        ids = set()
        for key, value in (bias or {}).items():
            # str.isdigit() also takes '²' and other scripts' digits: only ASCII decimals are ids
            if not (key.isascii() and key.isdigit()) or int(key) > MAX_INT32:
                raise RequestError(f"logit_bias keys must be token ids, got {key[:32]!r}", param="logit_bias")
            if int(key) in ids:  # "01" and "1" name one token
                raise RequestError(f"logit_bias names token id {int(key)} twice", param="logit_bias")
            ids.add(int(key))
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise RequestError(f"logit_bias values must lie in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]",
                                   param="logit_bias")
        return bias

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
                  "ignore_eos": self.ignore_eos or None, "stop_token_ids": self.stop_token_ids, "logprobs": logprobs,
                  "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                  "repetition_penalty": self.repetition_penalty, "min_p": self.min_p,
                  "logit_bias": [(int(k), v) for k, v in self.logit_bias.items()] if self.logit_bias else None}
        return {k: v for k, v in fields.items() if v is not None}

    def constraint(self) -> dict | None:
        """The grammar the answer must follow (protocol.Constraint fields), None for free text."""
        return one_constraint(response_format_constraint(self.response_format), guided_constraint(self))

    def choice_sampling(self, sampling: dict, index: int) -> dict:
        """The sampling of choice ``index`` of n: a given seed moves on by the index (as vLLM does),
        so that the choices differ and each repeats."""
        return {**sampling, "seed": (self.seed + index) % 2 ** 63} if self.seed is not None else sampling


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def to_broker(self) -> dict:
        """The message as the chat template sees it (extra fields such as ``name`` included)."""
        message = self.model_dump()
        if message["content"] is None:  # e.g. an assistant turn that only called tools
            message["content"] = ""
        return message


class FunctionDefinition(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: a call's arguments follow ``parameters`` (constrained decoding)


class Tool(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "auto" (the default with tools), "none", "required" or a named function
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)  # vLLM's extension
    # bookkeeping that OpenAI keeps and that has no effect on an answer here (no prompt cache to hint)
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    def constraint(self) -> dict | None:
        tools = [t.model_dump(exclude_unset=True) for t in self.tools or []]
        return one_constraint(tools_constraint(tools, self.tool_choice), super().constraint())

    @property
    def calls_tools(self) -> bool:
        """Are tools offered to the model (and its answer parsed for calls)?"""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict] | None:
        """The tool definitions as the client sent them, for the chat template."""
        return [t.model_dump(exclude_unset=True) for t in self.tools] if self.calls_tools else None

    @model_validator(mode="after")
    def _check(self):
        refuse_unknown(self, {**NOT_IMPLEMENTED, **OTHER_GRAMMARS})
        check_tool_choice(self.tool_choice, [t.function.name for t in self.tools or []])
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
    if kind in VIDEO_PART_TYPES:  # as the ZeroMQ path says it (broker/vision_qwen3vl.py)
        raise RequestError(f"{where}: video inputs are not supported (images only)", param=f"{where}.type",
                           code="video_not_supported")
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
        refuse_unknown(self, OTHER_GRAMMARS)
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


