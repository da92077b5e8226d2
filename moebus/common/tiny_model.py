"""``moebus init-model``: a complete Hugging Face model directory with random weights (numpy only):
config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json.
Weights are scaled so that activations keep unit size and logits have clear margins (greedy
continuations then do not hinge on rounding)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moebus.common.safetensors_io import save_file
from moebus.common.tiny_tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tokenizer
from moebus.cuda.dtypes import f32_to_bf16

PRESETS = {
    # 4 layers so that layer splits over 1-3 stages can be tested; experts do not fit a tiny cache
    "tiny": dict(vocab_size=384, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, intermediate_size=128, max_position_embeddings=2048,
                 rope_theta=10000.0),
    # the embedded default of `make serve`: ~100 MB of bf16 experts, fast on a 2-core CPU
    "demo": dict(vocab_size=2048, hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, num_experts=64, num_experts_per_tok=4,
                 moe_intermediate_size=128, intermediate_size=512, max_position_embeddings=4096,
                 rope_theta=1000000.0),
}
ARCH_NAMES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def hf_config(arch: str, preset: str) -> dict:
    p = dict(PRESETS[preset])
    common = dict(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
                  num_hidden_layers=p["num_hidden_layers"], num_attention_heads=p["num_attention_heads"],
                  num_key_value_heads=p["num_key_value_heads"], num_experts_per_tok=p["num_experts_per_tok"],
                  max_position_embeddings=p["max_position_embeddings"], rope_theta=p["rope_theta"],
                  rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
                  bos_token_id=None, eos_token_id=2, architectures=[ARCH_NAMES[arch]], model_type=arch)
    if arch == "qwen3_moe":
        common.update(head_dim=p["head_dim"], num_experts=p["num_experts"], norm_topk_prob=True,
                      moe_intermediate_size=p["moe_intermediate_size"], intermediate_size=p["intermediate_size"],
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None,
                      attention_bias=False)
    elif arch == "mixtral":
        common.update(num_local_experts=p["num_experts"], intermediate_size=p["moe_intermediate_size"],
                      sliding_window=None)
    else:
        raise ValueError(f"unknown arch {arch!r} (choose from {sorted(ARCH_NAMES)})")
    return common


def _random_weights(cfg: dict, arch: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    inter = cfg.get("moe_intermediate_size") if arch == "qwen3_moe" else cfg["intermediate_size"]

    def normal(shape, std):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def norm_weight(n):
        return 1.0 + normal((n,), 0.1)

    w = {"model.embed_tokens.weight": normal((v, d), 1.0), "model.norm.weight": norm_weight(d),
         "lm_head.weight": normal((v, d), 4.0 / np.sqrt(d))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm_weight(d), p + "post_attention_layernorm.weight": norm_weight(d),
                  p + "self_attn.q_proj.weight": normal((heads * hd, d), d ** -0.5),
                  p + "self_attn.k_proj.weight": normal((kv * hd, d), d ** -0.5),
                  p + "self_attn.v_proj.weight": normal((kv * hd, d), d ** -0.5),
                  p + "self_attn.o_proj.weight": normal((d, heads * hd), (heads * hd) ** -0.5)})
        if arch == "qwen3_moe":
            w[p + "self_attn.q_norm.weight"] = norm_weight(hd)
            w[p + "self_attn.k_norm.weight"] = norm_weight(hd)
            router, expert, names = p + "mlp.gate.weight", p + "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")
        else:
            router, expert, names = p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")
        w[router] = normal((experts, d), 2.0 * d ** -0.5)
        for e in range(experts):
            gate, up, down = (expert.format(e=e) + n + ".weight" for n in names)
            w[gate] = normal((inter, d), d ** -0.5)
            w[up] = normal((inter, d), d ** -0.5)
            w[down] = normal((d, inter), inter ** -0.5)
    return w


def init_model(out_dir: str | Path, arch: str = "qwen3_moe", preset: str = "tiny", seed: int = 0,
               dtype: str = "bf16") -> Path:
    """Write a model directory; returns its path. ``dtype``: 'bf16' or 'f32' tensors."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {sorted(PRESETS)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(arch, preset)
    tokenizer = train_tokenizer(cfg["vocab_size"] - 64, seed=0)
    weights = _random_weights(cfg, arch, np.random.default_rng(seed))
    if dtype == "bf16":
        tensors = {k: (f32_to_bf16(a), "BF16") for k, a in weights.items()}
    else:
        tensors = {k: (a, "F32") for k, a in weights.items()}
        cfg["torch_dtype"] = "float32"
    save_file(tensors, out / "model.safetensors")
    tokenizer.save(str(out / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")
    cfg["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": SPECIAL_TOKENS[1:], "model_max_length": cfg["max_position_embeddings"],
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [eos, tokenizer.token_to_id("<|endoftext|>")], "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "do_sample": False}, indent=2))
    return out
