"""Settings: one JSON file (``--config FILE`` or ``MOEBUS_CONFIG``) with environment overrides
``MOEBUS_<KEY>``, nested with ``__`` (``MOEBUS_API__PORT=8080``). Read once at the entry point and
passed down; processes derive their own copies with ``model_copy(update=...)``."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, JsonConfigSettingsSource, SettingsConfigDict

from moebus.common.errors import ConfigError


class _Section(BaseModel):
    # no setting takes an infinite or NaN number: inf MiB or seconds would pass `ge` / `gt` and
    # overflow where a worker turns them into bytes or a deadline
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class VisionSettings(_Section):
    """The lazy vision worker and the image limits (see docs/vision.md)."""

    lazy: bool = True  # false: start at boot and never unload
    idle_s: float = Field(60.0, gt=0)  # stop the vision worker this long after the last image
    vram_mib: list[int] | None = None  # None: the default for the GPU count (see docs/config.md)
    # the GPU (worker order) the vision worker runs on; auto: one whose cache can make room for it
    gpu: Literal["auto"] | Annotated[int, Field(ge=0)] = "auto"
    start_timeout_s: float = Field(120.0, gt=0)  # hand-back + start longer than this fails the waiting images
    # the hand-back frees at most this per GPU between two decode steps (64: within 2x the streams' gap, H200)
    handback_step_mib: float = Field(64.0, gt=0)
    max_image_bytes: int = Field(8 * 1024 * 1024, gt=0)  # one encoded image file
    max_image_pixels: int = Field(40_000_000, gt=0)  # width x height, checked from the header before decoding
    min_image_side_px: int = Field(2, ge=1)
    max_aspect_ratio: float = Field(20.0, ge=1.0)  # longer side / shorter side
    max_images_per_request: int = Field(8, ge=1, le=16)  # 16: the wire's frame limit
    allowed_url_prefixes: list[str] = Field(default_factory=list)  # http(s) URLs the api may fetch; none by default
    fetch_timeout_s: float = Field(10.0, gt=0)  # one connect or read of such a fetch
    fetch_deadline_s: float = Field(30.0, gt=0)  # the whole fetch, however the server trickles its bytes
    # under an MPS server (mps: true, or one of your own): the vision worker's kernels after the text
    # workers' (below_normal), or at their priority (normal); and its share of the SMs (None: all)
    mps_priority: Literal["normal", "below_normal"] = "below_normal"
    mps_sm_percent: int | None = Field(None, ge=1, le=100)


class ExpertsSettings(_Section):
    """How the experts are held in the host store and the VRAM cache (docs/expert-cache.md)."""

    # bf16: as stored (an FP8 checkpoint's dequantized); fp8: e4m3, 128x128 block scales (an FP8
    # checkpoint's own); int4: 4-bit, a scale and minimum per 128 inputs. Env MOEBUS_EXPERTS__DTYPE.
    dtype: Literal["bf16", "fp8", "int4"] = "bf16"
    # the next layer's experts copied ahead per layer (0: none); 2x out of the cache (workers/prefetch.py)
    prefetch_slots: int = Field(2, ge=0, le=64)


class AttentionSettings(_Section):
    """How the attention projections are held (docs/expert-cache.md, FP8 attention)."""

    # bf16: as stored (an FP8 checkpoint's dequantized); fp8: q/k/v/o as e4m3 with 128x128 block
    # scales (an FP8 checkpoint's own, a bf16 one's quantized at load), read by an FP8 GEMV at decode.
    # Env MOEBUS_ATTENTION__DTYPE.
    dtype: Literal["bf16", "fp8"] = "bf16"


class LmHeadSettings(_Section):
    """How the lm_head (the unembedding) is held (docs/config.md)."""

    # bf16: as stored; fp8: e4m3 with a scale per row and 128 inputs (quantized at load, a tied head's
    # copy of the embedding table too): half the VRAM, given to the expert cache, and half the bytes a
    # decode step's logits read. Env MOEBUS_LM_HEAD__DTYPE.
    dtype: Literal["bf16", "fp8"] = "bf16"


class ApiSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    admin_key: str | None = None  # /v1/vram; must differ from api_key
    allow_unauthenticated: bool = False  # serve a non-loopback host without api_key
    workers: int = Field(1, ge=1, le=64)  # waitress processes on one socket (the api is stateless)
    threads: int | None = Field(None, ge=1, le=4096)  # None: max_batch + max_queue + 16
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, le=1 << 30)
    # origins (``https://app.example:3000``) whose pages may send requests that change state, besides
    # the service's own (api/cross_site.py); none by default
    allowed_origins: list[str] = Field(default_factory=list)


class BrokerSettings(_Section):
    frontend: str = "tcp://127.0.0.1:5555"
    backend: str = "ipc://{run_dir}/backend.sock"  # {run_dir}: a private directory per serve
    heartbeat_s: float = Field(1.0, gt=0)
    heartbeat_liveness: int = Field(3, ge=1)
    drain_s: float = Field(10.0, ge=0)  # on SIGTERM: time running requests get to finish
    remote_gpus: list[int] = Field(default_factory=list)  # stages whose workers join from elsewhere
    curve_public_key: str | None = None  # z85; needed to bind or reach a non-loopback tcp address
    curve_secret_key: str | None = None  # z85; the broker's only
    curve_client_keys: list[str] = Field(default_factory=list)  # z85 public keys allowed in over CURVE
    curve_client_public_key: str | None = None  # z85; this client's or worker's own pair (allow-listed)
    curve_client_secret_key: str | None = None
    client_timeout_s: float = Field(5.0, gt=0)  # a ZeroMQ client silent this long: its requests are cancelled
    step_timeout_s: float = Field(60.0, gt=0)  # a stage with no reply to a STEP by then is restarted
    pipeline: bool = True  # 2+ stages, 2+ running sequences: one micro-batch in flight per stage
    lookahead: bool = True  # one stage: the next decode step is sent while one runs (broker/lookahead.py)
    vram_timeout_s: float = Field(30.0, gt=0)  # same for a VRAM request
    max_vram_queue: int = Field(16, ge=1)  # VRAM requests waiting; more are refused (503)
    tokenizer_threads: int = Field(2, ge=1, le=64)  # threads that tokenize and render prompts


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MOEBUS_", env_nested_delimiter="__", extra="forbid", validate_default=True,
        allow_inf_nan=False,  # as _Section's
    )

    model: str | None = None  # a Hugging Face model directory; None: the embedded demo model
    device: Literal["auto", "cuda", "cpu"] = "auto"
    gpus: list[int] = Field(default_factory=lambda: [0])
    # the embedded demo: 2 GPUs, ~46% of its experts cached, and room for the vision worker (docs/vision.md)
    emulated_vram_mib: list[float] = Field(default_factory=lambda: [64, 64])
    emulated_vram_dir: str | None = None  # ledgers of the emulated GPUs (default: the serve's run directory)
    kernel_cache_dir: str | None = None  # compiled kernels kept across starts (default: $MOEBUS_CACHE_DIR/kernels)
    layer_split: list[int] | None = None
    # cuda: the VRAM budget of each GPU (worker order), like vLLM's gpu_memory_utilization: caches, KV
    # and scratch are sized to stay within it, so moebus can share a large GPU (none: the whole GPU)
    gpu_memory_mib: list[float] = Field(default_factory=list)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)  # the same as a share of each GPU's total
    vram_elastic: bool = True
    vram_reserve_mib: list[int] = Field(default_factory=list)
    # cuda: run the workers as clients of a private MPS server (docs/vision.md): the vision worker's
    # kernels share the SMs with the text's steps instead of taking the GPU in time slices
    mps: bool = False
    segment_mib: int = Field(0, ge=0)  # 0: two expert slots a segment, in whole 2 MiB granules (cuda/memory/arena.py)
    vision: VisionSettings = Field(default_factory=VisionSettings)
    experts: ExpertsSettings = Field(default_factory=ExpertsSettings)
    attention: AttentionSettings = Field(default_factory=AttentionSettings)
    lm_head: LmHeadSettings = Field(default_factory=LmHeadSettings)
    max_batch: int = Field(8, ge=1)
    max_context: int = Field(2048, ge=16)
    # the KV cache's elements: bf16 halves what decode attention reads at long contexts; fp32 keeps
    # logits within 1e-3 of transformers' float32 (bf16: ~0.03); auto: bf16 on cuda, fp32 on cpu
    kv_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    max_queue: int = Field(256, ge=0)
    max_step_tokens: int = Field(512, ge=1)  # prompt tokens per step (longer prompts prefill in chunks)
    # prompt tokens per step while other sequences decode, so their inter-token gap stays short while
    # a long prompt is read (at the cost of its first token); None: max_step_tokens; auto: 16 on cuda
    # (8 streams within 2x of their gap while an 8k prompt is read, H200), None on cpu (docs/config.md)
    max_prefill_tokens_beside_decode: Literal["auto"] | Annotated[int, Field(ge=1)] | None = "auto"
    # experts a step beside decode rows may copy in for a prompt's chunk, in MiB: a chunk that needs
    # more spans steps (workers/spanning_chunk.py). 256: on an H200 (8 x 128 LLaVA under 8 GiB, a cold
    # image beside 2 text streams, tenth session) 128 gave the streams the same largest gap through the
    # image's prefill as 256 (17x their median: a chunk step took ~40-60 ms either way) and the image's
    # first token 4.1 s against 2.9 s; 0: off
    max_prefill_copy_mib_beside_decode: float = Field(256.0, ge=0)
    max_request_bytes: int = Field(64 * 1024 * 1024, ge=1024)  # largest ZeroMQ message a client may send
    launch_ahead: bool = True  # cuda, one stage: a look-ahead step is launched while the one before runs (workers/overlap.py)
    api: ApiSettings = Field(default_factory=ApiSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)

    @field_validator("model", "emulated_vram_dir", "kernel_cache_dir")
    @classmethod
    def _empty_is_unset(cls, value):
        return value or None  # MOEBUS_MODEL= (empty) means the default, as in docker-compose

    @field_validator("gpus", "emulated_vram_mib", "vram_reserve_mib", "layer_split", "gpu_memory_mib")
    @classmethod
    def _non_negative(cls, value):
        if value is not None and any(v < 0 for v in value):
            raise ValueError("values must be >= 0")
        return value


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"config key '{key}': {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def load_settings(config_file: str | os.PathLike | None = None, **overrides) -> Settings:
    """Settings from defaults < JSON file < environment < ``overrides`` (command-line flags).
    ``overrides`` with value None are ignored. Raises ConfigError naming the key and value."""
    path = config_file or os.environ.get("MOEBUS_CONFIG")
    if path and not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path:
        try:
            json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from e

    class _FromFile(Settings):
        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, **_):
            sources = [init_settings, env_settings]
            if path:
                sources.append(JsonConfigSettingsSource(settings_cls, json_file=path))
            return tuple(sources)

    cli = {k: v for k, v in overrides.items() if v is not None}
    try:
        merged = _FromFile(**cli)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None
    return Settings.model_validate(merged.model_dump())
