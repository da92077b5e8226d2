"""Every message moebus sends between processes, as data. On the wire a message is
``[type][msgpack header][raw tensor frames...]`` (see wire.py); tensors are raw frames named in the
header, never inside msgpack, never pickled. Each class validates its header when decoded.

Client <-> broker (DEALER -> ROUTER, frontend): GENERATE, CANCEL, VRAM, INFO, PING, TOKENIZE, DETOKENIZE
from the client; PARTIAL... then FINAL (or ERROR) per request, VRAM_REPLY, INFO_REPLY, PONG,
TOKENIZE_REPLY, DETOKENIZE_REPLY from the broker.
Broker <-> worker (DEALER identity gpu<i> -> ROUTER, backend): READY, HEARTBEAT, STEP_REPLY,
VRAM_REPLY, INFO_REPLY, ERROR from a worker; STEP, VRAM, INFO, HEARTBEAT, SHUTDOWN from the broker.
Broker <-> vision worker (DEALER identity ``vision``): VISION_READY, HEARTBEAT, ENCODE_REPLY,
WORKER_ERROR from it; ENCODE, HEARTBEAT, SHUTDOWN from the broker.

A field named in ``TENSOR_LISTS`` is a list of tensors, one raw frame each (a request's images)."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOKENS_PER_PROMPT = 1 << 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: the stream holds back this many characters
MAX_INT32 = 2 ** 31 - 1  # token ids, top_k, counts: what the int32 arrays of a step hold
MAX_INT64 = 2 ** 63 - 1
MAX_RESERVE_MIB = float(1 << 30)  # 1 PiB: times MIB (2**20) still far inside int64 bytes
MAX_GPUS = 64
MAX_ID_CHARS = 128

# Bounded scalar types: every number that crosses a process boundary fits the numpy dtype that the
# receiver puts it in, so no request can overflow an array while the broker plans a step.
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
Int64 = Annotated[int, Field(ge=-MAX_INT64, le=MAX_INT64)]
Mib = Annotated[float, Field(ge=0.0, le=MAX_RESERVE_MIB, allow_inf_nan=False)]
AnyMib = Annotated[float, Field(ge=-MAX_RESERVE_MIB, le=MAX_RESERVE_MIB, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)]
ShortText = Annotated[str, Field(max_length=256)]
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
PerGpu = Annotated[list[AnyMib], Field(max_length=MAX_GPUS)]
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 1024  # biased ids per request
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for a bias


class Message(BaseModel):
    """Base: ``TYPE`` is the first frame; fields named in ``TENSORS`` travel as raw frames."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, strict=False, allow_inf_nan=False)
    TYPE: ClassVar[bytes] = b""
    TENSORS: ClassVar[tuple[str, ...]] = ()
    TENSOR_LISTS: ClassVar[tuple[str, ...]] = ()


MAX_IMAGES_PER_MESSAGE = 16  # the wire's frame limit; vision.max_images_per_request is the real one


def _check_image_frames(images):
    """Encoded image files travel as 1-D uint8 frames, one per image."""
    if images is None:
        return images
    for i, image in enumerate(images):
        if image.dtype != np.uint8 or image.ndim != 1 or image.size == 0:
            raise ValueError(f"image {i} must be a non-empty 1-D uint8 frame (the file's bytes)")
    return images


# -- client <-> broker ----------------------------------------------------------------------------

class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)  # None: up to the end of the context
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_INT32)  # admission clamps it to the vocabulary
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    logprobs: int = Field(0, ge=0, le=20)  # also return the n most likely tokens per position
    # logit rules as vLLM defines them (cuda/kernels/penalties.py); the defaults are off
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: list[tuple[TokenId, float]] = Field(default_factory=list, max_length=MAX_LOGIT_BIAS)  # (id, bias)

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


MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema, regex or tool list: beyond this a compile is refused unread


class Constraint(BaseModel):
    """Structured output: the answer must match this (broker/grammar.py compiles it with llguidance).
    ``spec`` by ``kind``: json_schema: the schema as JSON text; json_object: empty (any JSON object);
    regex: the pattern; choice: a JSON list of strings; tool_calls: JSON ``{"tools": [{"name",
    "parameters", "strict"}], "choice": "required" | "auto" | <a tool's name>}``. ``param`` is the
    request field that asked for it, named by a 400 when it does not compile."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["json_schema", "json_object", "regex", "choice", "tool_calls"]
    spec: str = Field("", max_length=MAX_CONSTRAINT_CHARS)
    param: ShortText = "response_format"


class Generate(Message):
    """Start a request. Exactly one of prompt (text), prompt_tokens or messages (chat).

    ``images``: the encoded files (PNG, JPEG, WebP, GIF), one raw uint8 frame each, in the order of
    the prompt's image placeholders: ``{"type": "image"}`` parts of ``messages``, or the model's
    image token (one per image, unexpanded) in ``prompt`` / ``prompt_tokens``."""

    TYPE = b"GENERATE"
    TENSOR_LISTS = ("images",)
    id: RequestId
    prompt: str | None = None
    prompt_tokens: list[TokenId] | None = Field(None, max_length=MAX_TOKENS_PER_PROMPT)
    messages: list[dict[str, Any]] | None = Field(None, max_length=4096)
    sampling: Sampling = Field(default_factory=Sampling)
    images: list[np.ndarray] | None = Field(None, max_length=MAX_IMAGES_PER_MESSAGE)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)  # rendered by the chat template
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)  # extra template variables
    # the n choices of one request with images: GENERATEs of one client with the same image_group
    # and the same image files share one encode; image_group_size says how many there are
    image_group: RequestId | None = None
    image_group_size: int = Field(1, ge=1, le=16)  # 16: the api's most choices (n)
    constraint: Constraint | None = None  # structured output (after the reasoning block, if any)

    @field_validator("images")
    @classmethod
    def _image_frames(cls, images):
        return _check_image_frames(images)


class Cancel(Message):
    TYPE = b"CANCEL"
    id: RequestId


class Partial(Message):
    """New tokens of a request: ids, their text, logprobs, and top logprobs when asked for. With
    logprobs asked for, also each token's own text and that of each top token (so that a client
    without the tokenizer, such as the api, can name them)."""

    TYPE = b"PARTIAL"
    id: RequestId
    tokens: list[TokenId]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[TokenId, float]]] | None = None
    token_texts: list[str] | None = None
    top_texts: list[list[str]] | None = None
    # first Partial of a chat request only: True when the prompt ends inside an open <think> block
    # (the text begins as reasoning), False when not, None when the model has no reasoning blocks
    reasoning_open: bool | None = None


class Final(Message):
    TYPE = b"FINAL"
    id: RequestId
    finish_reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: Count
    completion_tokens: Count


class Error(Message):
    """A request (id) or a message (id None) failed; status is the HTTP status the api answers."""

    TYPE = b"ERROR"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    message: str
    type: ShortText = "invalid_request_error"
    param: ShortText | None = None
    code: ShortText | None = None
    status: int = Field(400, ge=100, le=599)


class Vram(Message):
    """Client: reserve_mib per GPU in worker order (None: bare VRAM, back to start-up sizes);
    query=True reports without changing anything. Broker -> worker: one value (None: bare)."""

    TYPE = b"VRAM"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)  # echoed in the reply, so a client can match them
    reserve_mib: Annotated[list[Mib], Field(max_length=MAX_GPUS)] | Mib | None = None
    query: bool = False


class VramReply(Message):
    """Worker: one value each. Broker -> client: one list entry per GPU, and the text ``line``."""

    TYPE = b"VRAM_REPLY"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    reserve_mib: PerGpu | AnyMib
    free_mib: PerGpu | AnyMib
    expert_slots: Annotated[list[Count], Field(max_length=MAX_GPUS)] | Count
    expert_cache_mib: PerGpu | AnyMib
    line: str = ""
    error: str | None = None


class Info(Message):
    TYPE = b"INFO"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)  # echoed in the reply, so a client can match them


class InfoReply(Message):
    TYPE = b"INFO_REPLY"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    stats: dict[str, Any]


class Tokenize(Message):
    """Tokenize ``prompt`` (plain text) or ``messages`` (through the chat template, with ``tools``
    and ``chat_template_kwargs`` as GENERATE renders them). Answered TOKENIZE_REPLY or ERROR."""

    TYPE = b"TOKENIZE"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, max_length=4096)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    add_generation_prompt: bool = True
    token_strs: bool = False  # also each token's own text


class TokenizeReply(Message):
    TYPE = b"TOKENIZE_REPLY"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    tokens: list[TokenId]
    token_strs: list[str] | None = None
    max_context: Count


class Detokenize(Message):
    """The text of token ids (special tokens dropped, as in a generated answer)."""

    TYPE = b"DETOKENIZE"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS_PER_PROMPT)


class DetokenizeReply(Message):
    TYPE = b"DETOKENIZE_REPLY"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    text: str


class Ping(Message):
    TYPE = b"PING"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)  # echoed in the reply, so a client can match them


class Pong(Message):
    TYPE = b"PONG"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    ready: bool


# -- broker <-> worker ----------------------------------------------------------------------------

class Ready(Message):
    """A worker has loaded its stage. ``generation`` is new for every worker process start."""

    TYPE = b"READY"
    gpu: int = Field(ge=0, lt=MAX_GPUS)
    generation: ShortText
    layers: tuple[Count, Count]
    device: ShortText
    expert_slots: Count = 0
    pid: Count = 0
    model: ShortText = ""  # the model directory's name, checked against the broker's
    max_batch: Count = 0  # the KV slots and context the stage was built for (0: not told)
    max_context: Count = 0


class Heartbeat(Message):
    TYPE = b"HEARTBEAT"
    generation: ShortText = ""


class Step(Message):
    """One forward step through a stage (see workers/batch.py). ``hidden`` for stages after the first,
    ``tokens`` for the first; sampling arrays are used by the last stage. ``embeds`` (R, D) float32
    and ``embed_rows`` (R,) int32, first stage only: rows of this step's T tokens whose token
    embedding is replaced (image embeddings; a prefill chunk carries only the rows inside it).
    The ``logit_*`` arrays come to the last stage only when some row asks for a penalty, a bias or
    min_p (cuda/kernels/penalties.py): ``logit_params`` (S, 4) float32 frequency, presence, repetition,
    min_p; ``logit_lengths`` (S,) int32 entries per row; per entry ``logit_ids``, ``logit_counts``
    (output count, 0: prompt only, -1: biased only) int32 and ``logit_bias`` float32.
    ``top_logprobs`` n > 0: the last stage returns the n most likely ids of the rows in
    ``logprob_rows`` (R,) int32, ascending and distinct (None: of every row, the old form); the
    reply's ``top_ids`` / ``top_logprobs`` are (R, n) in that order, so only rows that asked pay.
    ``mask`` (M, W) int32 (the bits of uint32 words) and ``mask_rows`` (S,) int32, last stage only and only when some row is
    constrained (structured outputs): allowed-token bitmasks, W = ceil(vocab / 32), and each row's
    mask (-1: unconstrained); see cuda/kernels/sampling.py.
    ``tokens_from``: the id of the step whose sampled ids are this step's tokens, row for row: a
    worker whose stage is the whole model keeps them (``tokens`` is then absent, every length 1).
    The broker sends such a step while the step it names still runs, so the stage never waits for
    the broker's hop (broker/lookahead.py). ``tokens_rows`` (S,) int32, with ``tokens_from`` only:
    which row of the named step's sampled ids each row takes (absent: row for row), when rows of
    that step sit this one out. ``held_row``: the row that continues the prompt chunk the worker
    holds part-done (workers/spanning_chunk.py; the broker's ``Sequence.held_feed``): its image rows
    are not sent again (the worker kept them at the chunk's first step: ~6.2 MB at LLaVA's 756 x
    2048), nor, with ``tokens_from``, its token ids (its ``tokens_rows`` entry is then a placeholder:
    the other rows take one id each). A worker that holds no such chunk fails the step."""

    TYPE = b"STEP"
    TENSORS = ("slots", "starts", "lengths", "tokens", "hidden", "temperature", "top_k", "top_p", "u",
               "embeds", "embed_rows", "logit_params", "logit_lengths", "logit_ids", "logit_counts", "logit_bias",
               "logprob_rows", "mask", "mask_rows", "rope_positions", "deepstack", "deepstack_rows", "tokens_rows")
    step_id: Int64
    top_logprobs: int = Field(0, ge=0, le=20)
    tokens_from: Int64 | None = None
    held_row: int | None = Field(None, ge=0, le=MAX_INT32)
    slots: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    temperature: np.ndarray | None = None
    top_k: np.ndarray | None = None
    top_p: np.ndarray | None = None
    u: np.ndarray | None = None
    embeds: np.ndarray | None = None
    embed_rows: np.ndarray | None = None
    logit_params: np.ndarray | None = None
    logit_lengths: np.ndarray | None = None
    logit_ids: np.ndarray | None = None
    logit_counts: np.ndarray | None = None
    logit_bias: np.ndarray | None = None
    logprob_rows: np.ndarray | None = None
    mask: np.ndarray | None = None
    mask_rows: np.ndarray | None = None
    # Qwen3-VL, every stage (workers/qwen3vl_step.py): rope_positions (T, 3) int32 M-RoPE positions;
    # deepstack (L, R, D) float32 added at deepstack_rows (R,) int32 after language-model layer l < L
    rope_positions: np.ndarray | None = None
    deepstack: np.ndarray | None = None
    deepstack_rows: np.ndarray | None = None
    tokens_rows: np.ndarray | None = None

    @model_validator(mode="after")
    def _consistent(self):
        check_step_arrays(self)
        return self


class StepReply(Message):
    TYPE = b"STEP_REPLY"
    TENSORS = ("hidden", "tokens", "logprobs", "top_ids", "top_logprobs", "pending_rows")
    step_id: Int64
    generation: ShortText
    compute_s: Seconds = 0.0  # time the stage spent on the step, so the broker can tell its own overhead
    hidden: np.ndarray | None = None
    tokens: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # (N,) int32, ascending: rows of the step whose feed the stage has not finished (a prompt's chunk
    # that spans steps, workers/spanning_chunk.py): their tokens are placeholders, their ``fed`` does
    # not move, and the broker sends the same feed again (broker/steps.py). None: every row is done.
    pending_rows: np.ndarray | None = None

    @model_validator(mode="after")
    def _pending_rows(self):
        rows = self.pending_rows
        if rows is not None and (rows.ndim != 1 or rows.dtype.kind not in "iu" or
                                 (rows.size and (int(rows.min()) < 0 or np.any(np.diff(rows) <= 0)))):
            raise ValueError(f"pending_rows must be ascending distinct rows, got {rows.dtype}{list(rows.shape)}")
        return self


class WorkerError(Message):
    """A worker could not run a step; fatal=True: it is exiting (e.g. a poisoned CUDA context)."""

    TYPE = b"WORKER_ERROR"
    generation: ShortText
    step_id: Int64 | None = None
    message: str
    fatal: bool = False


class Shutdown(Message):
    TYPE = b"SHUTDOWN"


def _vector(step: Step, name: str, kinds: str, size: int | None) -> np.ndarray | None:
    array = getattr(step, name)
    if array is None:
        return None
    if array.ndim != 1 or array.dtype.kind not in kinds or (size is not None and array.shape[0] != size):
        raise ValueError(f"{name} must be a 1-D array of {size} ({kinds}) values, got {array.dtype}{list(array.shape)}")
    return array


SMALL_ARRAY = 64  # up to this many values, Python's min/max/sum beat numpy's reductions (a decode step)


def _span(array: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty integer vector as Python integers (exact for every integer dtype)."""
    if array.size <= SMALL_ARRAY:
        values = array.tolist()
        return min(values), max(values)
    return int(array.min()), int(array.max())


def _total(array: np.ndarray) -> int:
    return sum(array.tolist()) if array.size <= SMALL_ARRAY else int(array.astype(np.int64).sum())


def check_step_arrays(step: Step) -> None:
    """A STEP whose arrays disagree (batch sizes, token counts, negative positions) is refused by
    the codec, before a stage indexes anything with it."""
    slots = _vector(step, "slots", "iu", None)
    num_seqs = slots.shape[0]
    starts, lengths = _vector(step, "starts", "iu", num_seqs), _vector(step, "lengths", "iu", num_seqs)
    for name in ("temperature", "top_p", "u"):
        _vector(step, name, "f", num_seqs)
    _vector(step, "top_k", "iu", num_seqs)
    if num_seqs:
        (low_slot, _), (low_start, high_start) = _span(slots), _span(starts)
        low_length, high_length = _span(lengths)
        if low_slot < 0 or low_start < 0 or low_length < 1 or high_start + high_length > MAX_INT32:
            raise ValueError("slots and starts must be >= 0, lengths >= 1")
    num_tokens = _total(lengths)
    tokens = _vector(step, "tokens", "iu", num_tokens)
    held = step.held_row
    if held is not None and (held >= num_seqs or int(lengths[held]) < 2):
        raise ValueError("held_row must be a prompt chunk's row (length > 1) of the step")
    held_tokens = 0 if held is None else int(lengths[held]) - 1  # with tokens_from: one placeholder id
    if step.tokens_from is not None and (tokens is not None or step.hidden is not None
                                         or num_tokens - held_tokens != num_seqs):
        raise ValueError("a step with tokens_from carries no tokens or hidden states, and one token per sequence "
                         "(but its held_row)")
    tokens_rows = _vector(step, "tokens_rows", "iu", num_seqs)
    if tokens_rows is not None and (step.tokens_from is None or (num_seqs and _span(tokens_rows)[0] < 0)):
        raise ValueError("tokens_rows comes with tokens_from only, and names rows >= 0")
    if tokens is not None and tokens.size:
        low_token, high_token = _span(tokens)
        if low_token < 0 or high_token > MAX_INT32:
            raise ValueError("token ids must be in [0, 2**31)")
    hidden = step.hidden
    if hidden is not None and (hidden.ndim != 2 or hidden.dtype.kind != "f" or hidden.shape[0] != num_tokens):
        raise ValueError(f"hidden must be ({num_tokens}, D) floats, got {hidden.dtype}{list(hidden.shape)}")
    rows, embeds = _vector(step, "embed_rows", "iu", None), step.embeds
    if (rows is None) != (embeds is None):
        raise ValueError("embeds and embed_rows come together")
    low_row, high_row = _span(rows) if rows is not None and rows.size else (0, 0)
    if rows is not None and (embeds.ndim != 2 or embeds.dtype.kind != "f" or embeds.shape[0] != rows.shape[0]
                             or (rows.size and (low_row < 0 or high_row >= num_tokens))):
        raise ValueError(f"embeds must be (R, D) floats for R embed_rows in [0, {num_tokens})")
    _check_qwen3vl_arrays(step, num_tokens)
    asked = _vector(step, "logprob_rows", "iu", None)
    if asked is not None and asked.size and (not step.top_logprobs or asked.min() < 0 or asked.max() >= num_seqs
                                             or np.any(np.diff(asked.astype(np.int64)) <= 0)):
        raise ValueError(f"logprob_rows must be ascending distinct rows in [0, {num_seqs}), with top_logprobs > 0")
    _check_masks(step, num_seqs)


def _check_masks(step: Step, num_seqs: int) -> None:
    rows, mask = _vector(step, "mask_rows", "i", num_seqs), step.mask
    if (rows is None) != (mask is None):
        raise ValueError("mask and mask_rows come together")
    if mask is not None and (mask.ndim != 2 or mask.dtype != np.int32):
        raise ValueError(f"mask must be (M, W) int32 bit words, got {mask.dtype}{list(mask.shape)}")
    if rows is not None and rows.size and (int(rows.min()) < -1 or int(rows.max()) >= mask.shape[0]):
        raise ValueError(f"mask_rows must be -1 or rows of the {mask.shape[0]} masks")


def _check_qwen3vl_arrays(step: Step, num_tokens: int) -> None:
    positions = step.rope_positions
    low, high = _span(positions.ravel()) if positions is not None and positions.size else (0, 0)
    if positions is not None and (positions.dtype.kind not in "iu" or positions.shape != (num_tokens, 3)
                                  or low < 0 or high > MAX_INT32):
        raise ValueError(f"rope_positions must be ({num_tokens}, 3) integers in [0, 2**31)")
    rows, deepstack = _vector(step, "deepstack_rows", "iu", None), step.deepstack
    if (rows is None) != (deepstack is None):
        raise ValueError("deepstack and deepstack_rows come together")
    if rows is not None and (deepstack.ndim != 3 or deepstack.dtype.kind != "f" or deepstack.shape[1] != rows.shape[0]
                             or (rows.size and (_span(rows)[0] < 0 or _span(rows)[1] >= num_tokens))):
        raise ValueError(f"deepstack must be (L, R, D) floats for R deepstack_rows in [0, {num_tokens})")


# -- broker <-> vision worker ---------------------------------------------------------------------

class VisionReady(Message):
    """The vision worker has its device context and weights uploaded and is warm (its kernels ran
    once), so the first ENCODE does not compile. ``start_s``: its own part of the start.
    ``device_bytes``: its weights (cpu: what it charged the ledger); ``measured_bytes``: cuda, what
    its start took from the GPU as the driver counts it, context included (0: not measured)."""

    TYPE = b"VISION_READY"
    generation: ShortText
    gpu: int = Field(ge=0, lt=MAX_GPUS)
    device: ShortText
    pid: Count
    device_bytes: Annotated[int, Field(ge=0, le=MAX_INT64)] = 0
    measured_bytes: Annotated[int, Field(ge=0, le=MAX_INT64)] = 0
    num_image_tokens: Count
    hidden_size: Count
    start_s: Seconds = 0.0


class Encode(Message):
    """Encode one request's images (the files' bytes, one raw frame each) into embeddings."""

    TYPE = b"ENCODE"
    TENSOR_LISTS = ("images",)
    encode_id: Int64
    request_id: RequestId
    images: list[np.ndarray] = Field(min_length=1, max_length=MAX_IMAGES_PER_MESSAGE)

    @field_validator("images")
    @classmethod
    def _image_frames(cls, images):
        return _check_image_frames(images)


class EncodeReply(Message):
    """``embeds`` (N * num_image_tokens, D) float32, the images' rows in order; or ``error`` (an
    image the worker could not decode: ``image`` is its index) and no embeds. Qwen3-VL's DeepStack
    features for the same rows: ``embeds`` (1 + L, rows, D) float32, the embeddings and then the L
    features stacked (what its vision worker sends), or ``deepstack`` (L, rows, D) beside 2-D embeds.
    ``measured_bytes``: on cuda, the first encode of a worker that started without a warm-up says what
    the worker holds on its GPU after it as the driver counts it (its VISION_READY's figure reckoned
    that encode's scratch); 0: not measured."""

    TYPE = b"ENCODE_REPLY"
    TENSORS = ("embeds", "deepstack")
    encode_id: Int64
    generation: ShortText
    compute_s: Seconds = 0.0
    measured_bytes: Annotated[int, Field(ge=0, le=MAX_INT64)] = 0  # cuda, a lazy worker's first encode (below)
    embeds: np.ndarray | None = None
    deepstack: np.ndarray | None = None
    error: str | None = None
    image: Count | None = None


MESSAGES: dict[bytes, type[Message]] = {
    cls.TYPE: cls for cls in (Generate, Cancel, Partial, Final, Error, Vram, VramReply, Info, InfoReply, Ping,
                              Pong, Ready, Heartbeat, Step, StepReply, WorkerError, Shutdown, VisionReady,
                              Encode, EncodeReply, Tokenize, TokenizeReply, Detokenize, DetokenizeReply)
}
