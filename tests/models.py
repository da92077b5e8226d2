"""Tiny models for tests: made by moebus' own init-model, and made and saved by transformers."""
from __future__ import annotations

from pathlib import Path

from moebus.common.tiny_model import init_model

HF_SHAPES = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=1024)


def make_hf_model(out_dir: Path, arch: str, dtype: str = "bf16", seed: int = 0) -> Path:
    """A model built by transformers, weights scaled for clear logit margins, saved by save_pretrained."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**HF_SHAPES, head_dim=16, num_experts=8, moe_intermediate_size=32,
                             intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1])
        model = Qwen3MoeForCausalLM(cfg)
    else:
        cfg = MixtralConfig(**HF_SHAPES, num_local_experts=6, intermediate_size=32)
        model = MixtralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                fan_in = p.shape[-1]
                scale = 4.0 if "lm_head" in name else 2.0 if ("gate.weight" in name and "proj" not in name) else 1.0
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else scale / fan_in ** 0.5))
    if dtype in ("bf16", "f16"):
        model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def make_init_model(out_dir: Path, arch: str, preset: str = "tiny", seed: int = 0) -> Path:
    return init_model(out_dir, arch, preset, seed=seed)


def hf_greedy(hf, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation, going on past end-of-sequence tokens (its eos handling is
    switched off rather than suppressed with min_new_tokens, which would mask those tokens)."""
    import torch

    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def tied_copy(src: Path, dst: Path) -> Path:
    """``src`` (one safetensors file) with ``tie_word_embeddings``: its lm_head is the embedding table
    (the stored lm_head.weight is then not read)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return Path(dst)


def fp8_lm_head_copy(src: Path, dst: Path) -> Path:
    """``src`` (one safetensors file, bf16) with only its lm_head stored as FP8 (codes and 128 x 128
    block scales, a ``quantization_config`` that converts everything): a checkpoint that does not
    leave the lm_head unconverted."""
    import json
    import shutil

    from moebus.common.fp8_checkpoint import Fp8Quantization, fp8_stored
    from moebus.common.safetensors_io import SafetensorsFile, save_file

    shutil.copytree(src, dst)
    f = SafetensorsFile(src / "model.safetensors")
    save_file(fp8_stored({name: f.array(name) for name in f.keys()}, lambda name: name == "lm_head.weight"),
              dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": Fp8Quantization().as_config()}))
    return Path(dst)
