"""Tensor names per architecture: one small table each, so that another MoE family is a few lines.
Names are relative to the language model's prefix (``model.`` / ``lm_head.`` in a causal LM)."""
from __future__ import annotations

from dataclasses import dataclass

from moebus.common.errors import CheckpointError


@dataclass(frozen=True)
class Arch:
    name: str
    hf_names: tuple[str, ...]
    router: str  # relative to the layer prefix
    expert: str  # relative to the layer prefix, {e} = expert index
    gate: str
    up: str
    down: str
    qk_norm: bool
    default_norm_topk_prob: bool
    moe_intermediate_key: str
    # fused experts as current transformers keeps them in memory: (E, 2I, D) and (E, D, I)
    fused_gate_up: str | None = None
    fused_down: str | None = None
    # shared expert (Qwen2-MoE): prefix and its sigmoid gate, relative to the layer prefix
    shared_expert: str | None = None
    shared_expert_gate: str | None = None


LAYER = "model.layers.{i}."
ATTN = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
        "o": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
        "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}
DENSE_MLP = {"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}
GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}

ARCHS = {
    "qwen3_moe": Arch(
        name="qwen3_moe", hf_names=("Qwen3MoeForCausalLM",), router="mlp.gate.weight",
        expert="mlp.experts.{e}.", gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight",
        qk_norm=True, default_norm_topk_prob=False, moe_intermediate_key="moe_intermediate_size",
        fused_gate_up="mlp.experts.gate_up_proj", fused_down="mlp.experts.down_proj"),
    "mixtral": Arch(
        name="mixtral", hf_names=("MixtralForCausalLM",), router="block_sparse_moe.gate.weight",
        expert="block_sparse_moe.experts.{e}.", gate="w1.weight", up="w3.weight", down="w2.weight",
        qk_norm=False, default_norm_topk_prob=True, moe_intermediate_key="intermediate_size",
        fused_gate_up="mlp.experts.gate_up_proj", fused_down="mlp.experts.down_proj"),
}


def arch_for(hf_name: str, where: str) -> Arch:
    for arch in ARCHS.values():
        if hf_name in arch.hf_names or hf_name == arch.name:
            return arch
    known = ", ".join(n for a in ARCHS.values() for n in a.hf_names)
    raise CheckpointError(f"{where}: architecture {hf_name!r} is not supported (supported: {known}, "
                          "and LlavaForConditionalGeneration around one of them)")
