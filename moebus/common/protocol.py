"""Every message moebus sends between processes, as data. On the wire a message is
``[type][msgpack header][raw tensor frames...]`` (see wire.py); tensors are raw frames named in the
header, never inside msgpack, never pickled. Each class validates its header when decoded.

Client <-> broker (DEALER -> ROUTER, frontend): GENERATE, CANCEL, VRAM, INFO, PING, TOKENIZE, DETOKENIZE
from the client; PARTIAL... then FINAL (or ERROR) per request, VRAM_REPLY, INFO_REPLY, PONG,
TOKENIZE_REPLY, DETOKENIZE_REPLY from the broker.
Broker <-> worker (DEALER identity gpu<i> -> ROUTER, backend): READY, HEARTBEAT, STEP_REPLY,
VRAM_REPLY, INFO_REPLY, ERROR from a worker; STEP, VRAM, INFO, HEARTBEAT, SHUTDOWN from the broker."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOKENS_PER_PROMPT = 1 << 20
MAX_STOP_STRINGS = 16
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 1024  # biased ids per request
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for a bias


class Message(BaseModel):
    """Base: ``TYPE`` is the first frame; fields named in ``TENSORS`` travel as raw frames."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, strict=False)
    TYPE: ClassVar[bytes] = b""
    TENSORS: ClassVar[tuple[str, ...]] = ()


# -- client <-> broker ----------------------------------------------------------------------------

class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int | None = Field(None, ge=1)  # None: up to the end of the context
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    logprobs: int = Field(0, ge=0, le=20)  # also return the n most likely tokens per position
    # logit rules as vLLM defines them (cuda/penalties.py); the defaults are off
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: list[tuple[int, float]] = Field(default_factory=list, max_length=MAX_LOGIT_BIAS)  # (id, bias)

    @field_validator("logit_bias")
    @classmethod
    def _bias_pairs(cls, pairs):
        if any(t < 0 for t, _ in pairs) or len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias ids must be unique and >= 0")
        if any(not -MAX_ABS_LOGIT_BIAS <= b <= MAX_ABS_LOGIT_BIAS for _, b in pairs):
            raise ValueError(f"logit_bias values must lie in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
        return pairs

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def has_logit_rules(self) -> bool:
        """Does the last stage need to adjust this request's logits before sampling?"""
        return self.has_penalties or bool(self.logit_bias) or self.min_p > 0


class Generate(Message):
    """Start a request. Exactly one of prompt (text), prompt_tokens or messages (chat)."""

    TYPE = b"GENERATE"
    id: str = Field(min_length=1, max_length=128)
    prompt: str | None = None
    prompt_tokens: list[int] | None = Field(None, max_length=MAX_TOKENS_PER_PROMPT)
    messages: list[dict[str, Any]] | None = Field(None, max_length=4096)
    sampling: Sampling = Field(default_factory=Sampling)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)  # rendered by the chat template
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)  # extra template variables

    @field_validator("prompt_tokens")
    @classmethod
    def _non_negative_ids(cls, ids):
        if ids is not None and any(i < 0 for i in ids):
            raise ValueError("token ids must be >= 0")
        return ids


class Cancel(Message):
    TYPE = b"CANCEL"
    id: str = Field(min_length=1, max_length=128)


class Partial(Message):
    """New tokens of a request: ids, their text, logprobs, and top logprobs when asked for. With
    logprobs asked for, also each token's own text and that of each top token (so that a client
    without the tokenizer, such as the api, can name them)."""

    TYPE = b"PARTIAL"
    id: str
    tokens: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    token_texts: list[str] | None = None
    top_texts: list[list[str]] | None = None
    # first Partial of a chat request only: True when the prompt ends inside an open <think> block
    # (the text begins as reasoning), False when not, None when the model has no reasoning blocks
    reasoning_open: bool | None = None


class Final(Message):
    TYPE = b"FINAL"
    id: str
    finish_reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: int
    completion_tokens: int


class Error(Message):
    """A request (id) or a message (id None) failed; status is the HTTP status the api answers."""

    TYPE = b"ERROR"
    id: str | None = None
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    status: int = 400


class Vram(Message):
    """Client: reserve_mib per GPU in worker order (None: bare VRAM, back to start-up sizes);
    query=True reports without changing anything. Broker -> worker: one value (None: bare)."""

    TYPE = b"VRAM"
    id: str | None = Field(None, max_length=128)  # echoed in the reply, so a client can match them
    reserve_mib: list[float] | float | None = None
    query: bool = False


class VramReply(Message):
    """Worker: one value each. Broker -> client: one list entry per GPU, and the text ``line``."""

    TYPE = b"VRAM_REPLY"
    id: str | None = None
    reserve_mib: list[float] | float
    free_mib: list[float] | float
    expert_slots: list[int] | int
    expert_cache_mib: list[float] | float
    line: str = ""
    error: str | None = None


class Info(Message):
    TYPE = b"INFO"
    id: str | None = Field(None, max_length=128)  # echoed in the reply, so a client can match them


class InfoReply(Message):
    TYPE = b"INFO_REPLY"
    id: str | None = None
    stats: dict[str, Any]


class Tokenize(Message):
    """Tokenize ``prompt`` (plain text) or ``messages`` (through the chat template, with ``tools``
    and ``chat_template_kwargs`` as GENERATE renders them). Answered TOKENIZE_REPLY or ERROR."""

    TYPE = b"TOKENIZE"
    id: str | None = Field(None, max_length=128)
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, max_length=4096)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    add_generation_prompt: bool = True
    token_strs: bool = False  # also each token's own text


class TokenizeReply(Message):
    TYPE = b"TOKENIZE_REPLY"
    id: str | None = None
    tokens: list[int]
    token_strs: list[str] | None = None
    max_context: int


class Detokenize(Message):
    """The text of token ids (special tokens dropped, as in a generated answer)."""

    TYPE = b"DETOKENIZE"
    id: str | None = Field(None, max_length=128)
    tokens: list[int] = Field(max_length=MAX_TOKENS_PER_PROMPT)


class DetokenizeReply(Message):
    TYPE = b"DETOKENIZE_REPLY"
    id: str | None = None
    text: str


class Ping(Message):
    TYPE = b"PING"
    id: str | None = Field(None, max_length=128)  # echoed in the reply, so a client can match them


class Pong(Message):
    TYPE = b"PONG"
    id: str | None = None
    ready: bool


# -- broker <-> worker ----------------------------------------------------------------------------

class Ready(Message):
    """A worker has loaded its stage. ``generation`` is new for every worker process start."""

    TYPE = b"READY"
    gpu: int
    generation: str
    layers: tuple[int, int]
    device: str
    expert_slots: int = 0
    pid: int = 0


class Heartbeat(Message):
    TYPE = b"HEARTBEAT"
    generation: str = ""


class Step(Message):
    """One forward step through a stage (see workers/batch.py). ``hidden`` for stages after the first,
    ``tokens`` for the first; sampling arrays are used by the last stage. The ``logit_*`` arrays come
    to the last stage only when some row asks for a penalty, a bias or min_p (cuda/penalties.py):
    ``logit_params`` (S, 4) float32 frequency, presence, repetition, min_p; ``logit_lengths`` (S,)
    int32 entries per row; per entry ``logit_ids``, ``logit_counts`` (output count, 0: prompt only,
    -1: biased only) int32 and ``logit_bias`` float32."""

    TYPE = b"STEP"
    TENSORS = ("slots", "starts", "lengths", "tokens", "hidden", "temperature", "top_k", "top_p", "u",
               "logit_params", "logit_lengths", "logit_ids", "logit_counts", "logit_bias")
    step_id: int
    top_logprobs: int = 0
    slots: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    temperature: np.ndarray | None = None
    top_k: np.ndarray | None = None
    top_p: np.ndarray | None = None
    u: np.ndarray | None = None
    logit_params: np.ndarray | None = None
    logit_lengths: np.ndarray | None = None
    logit_ids: np.ndarray | None = None
    logit_counts: np.ndarray | None = None
    logit_bias: np.ndarray | None = None


class StepReply(Message):
    TYPE = b"STEP_REPLY"
    TENSORS = ("hidden", "tokens", "logprobs", "top_ids", "top_logprobs")
    step_id: int
    generation: str
    compute_s: float = 0.0  # time the stage spent on the step, so the broker can tell its own overhead
    hidden: np.ndarray | None = None
    tokens: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


class WorkerError(Message):
    """A worker could not run a step; fatal=True: it is exiting (e.g. a poisoned CUDA context)."""

    TYPE = b"WORKER_ERROR"
    generation: str
    step_id: int | None = None
    message: str
    fatal: bool = False


class Shutdown(Message):
    TYPE = b"SHUTDOWN"


MESSAGES: dict[bytes, type[Message]] = {
    cls.TYPE: cls for cls in (Generate, Cancel, Partial, Final, Error, Vram, VramReply, Info, InfoReply, Ping,
                              Pong, Ready, Heartbeat, Step, StepReply, WorkerError, Shutdown,
                              Tokenize, TokenizeReply, Detokenize, DetokenizeReply)
}
