"""The model's shape, normalised from ``config.json`` as the Hub's checkpoints write it and as
current transformers writes it (``num_experts`` vs ``num_local_experts``, ``rope_theta`` vs
``rope_parameters``), for the architectures in ``common/arch.py``."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moebus.common.errors import CheckpointError

SUPPORTED_ROPE = ("default",)


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # key of common.arch.ARCHS
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int  # dense MLP layers (mlp_only_layers), if any
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qk_norm: bool
    tie_word_embeddings: bool
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts
    sliding_window: int = 0  # 0: full attention
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    wrapper: str | None = None  # "llava" / "qwen3_vl" when the language model sits inside a vision checkpoint
    mrope_section: tuple[int, ...] = ()  # Qwen3-VL's interleaved M-RoPE (common/qwen3vl_config.py); () = 1-D RoPE
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """gate | up | down of one expert, in that order (the host store and arena blob layout)."""
        d, i = self.hidden_size, self.moe_intermediate_size
        return {"gate": (i, d), "up": (i, d), "down": (d, i)}


def _rope_theta(cfg: dict, where: str) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE:
        raise CheckpointError(f"{where}: rope type {rope_type!r} is not supported (only {SUPPORTED_ROPE})")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{where}: no rope_theta (neither rope_parameters.rope_theta nor rope_theta)")
    return float(theta)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _require(cfg: dict, key: str, where: str):
    if cfg.get(key) is None:
        raise CheckpointError(f"{where}: missing key {key!r}")
    return cfg[key]


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """ModelConfig from a config.json dict. Raises CheckpointError naming the file and key."""
    from moebus.common.arch import arch_for  # late: arch imports this module

    from moebus.common import qwen3vl_config

    archs = raw.get("architectures") or []
    wrapper = None
    cfg = raw
    if qwen3vl_config.is_qwen3vl(raw):
        wrapper, cfg, archs = "qwen3_vl", qwen3vl_config.text_config(raw, where), ["Qwen3MoeForCausalLM"]
    elif archs and archs[0] == "LlavaForConditionalGeneration":
        wrapper, cfg = "llava", raw.get("text_config") or {}
        archs = cfg.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(cfg.get("model_type"), "?")]
    name = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(cfg.get("model_type"), "?")
    arch = arch_for(name, where)
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if num_experts is None:
        raise CheckpointError(f"{where}: missing key 'num_experts' (or 'num_local_experts')")
    moe_inter = cfg.get("moe_intermediate_size") if arch.moe_intermediate_key == "moe_intermediate_size" \
        else cfg.get("intermediate_size")
    num_layers = int(_require(cfg, "num_hidden_layers", where))
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense |= {i for i in range(num_layers) if (i + 1) % step != 0}
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return ModelConfig(
        arch=arch.name,
        vocab_size=int(_require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        num_experts=int(num_experts),
        top_k=int(_require(cfg, "num_experts_per_tok", where)),
        moe_intermediate_size=int(moe_inter or 0),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", arch.default_norm_topk_prob)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, where),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        qk_norm=arch.qk_norm,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        dense_layers=tuple(sorted(dense)),
        sliding_window=int(window or 0),
        eos_token_ids=_ids(cfg.get("eos_token_id", raw.get("eos_token_id"))),
        bos_token_id=cfg.get("bos_token_id"),
        wrapper=wrapper,
        extra={"vision_config": raw.get("vision_config")} if wrapper else {},
        mrope_section=qwen3vl_config.mrope_section(raw, int(cfg.get("head_dim") or hidden // heads), where)
        if wrapper == "qwen3_vl" else (),
    )


_MODEL_TYPE_TO_ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (is {model_dir} a Hugging Face model directory?)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e
    return parse_config(raw, str(path))
