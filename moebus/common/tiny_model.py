"""``moebus init-model``: a complete Hugging Face model directory with random weights (numpy only):
config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json.
Weights are scaled so that activations keep unit size and logits have clear margins (greedy
continuations then do not hinge on rounding)."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np

from moebus.common.qwen3vl_tiny import init_qwen3vl
from moebus.common.safetensors_io import save_file
from moebus.common.tiny_script import add_script_tokens, scripted_tensors
from moebus.common.tiny_tokenizer import CHATML_TEMPLATE, IMAGE_TOKEN, SPECIAL_TOKENS, train_tokenizer
from moebus.common.tiny_vision import llava_config, llava_name, processor_config, vision_tensors
from moebus.common.fp8_checkpoint import Fp8Quantization, fp8_stored, is_qwen_fp8_weight
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
    # Qwen3-30B-A3B's shapes (48 layers, 128 experts of 9 MiB, top-8): for GPU benchmarks, usually
    # with fewer layers (init-model --layers 8)
    "a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=768, intermediate_size=6144, max_position_embeddings=40960,
                rope_theta=1000000.0),
}
PRESET_SHARDED = {"tiny": False, "demo": False, "a3b": True}  # large presets: one shard per layer
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


class _Random:
    """Random weights: normal draws for the small presets. Large presets (bf16 only) take each
    tensor as a window at a random offset of a 64 M-element normal pool per (std, mean), already in
    bf16: a 10 GB checkpoint is written at disk speed instead of taking minutes of number drawing."""

    POOL = 1 << 26

    def __init__(self, seed: int, fast: bool):
        self.rng = np.random.default_rng(seed)
        self.fast = fast
        self.pools: dict[tuple[float, float], np.ndarray] = {}

    def normal(self, shape, std, mean=0.0) -> np.ndarray:
        """float32 draws, or (fast) bf16 bits as uint16."""
        if not self.fast:
            return self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std) + np.float32(mean)
        key = (float(std), float(mean))
        if key not in self.pools:
            self.pools[key] = f32_to_bf16(self.rng.standard_normal(self.POOL, dtype=np.float32) * np.float32(std)
                                          + np.float32(mean))
        count = int(np.prod(shape))
        start = int(self.rng.integers(0, self.POOL))
        if start + count <= self.POOL:
            return self.pools[key][start : start + count].reshape(shape)
        return np.take(self.pools[key], np.arange(start, start + count) % self.POOL).reshape(shape)


def _global_tensors(cfg: dict, r: _Random) -> dict[str, np.ndarray]:
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    return {"model.embed_tokens.weight": r.normal((v, d), 1.0), "model.norm.weight": r.normal((d,), 0.1, 1.0),
            "lm_head.weight": r.normal((v, d), 4.0 / np.sqrt(d))}


def _layer_tensors(cfg: dict, arch: str, i: int, r: _Random) -> dict[str, np.ndarray]:
    d = cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    inter = cfg.get("moe_intermediate_size") if arch == "qwen3_moe" else cfg["intermediate_size"]
    p = f"model.layers.{i}."
    w = {p + "input_layernorm.weight": r.normal((d,), 0.1, 1.0),
         p + "post_attention_layernorm.weight": r.normal((d,), 0.1, 1.0),
         p + "self_attn.q_proj.weight": r.normal((heads * hd, d), d ** -0.5),
         p + "self_attn.k_proj.weight": r.normal((kv * hd, d), d ** -0.5),
         p + "self_attn.v_proj.weight": r.normal((kv * hd, d), d ** -0.5),
         p + "self_attn.o_proj.weight": r.normal((d, heads * hd), (heads * hd) ** -0.5)}
    if arch == "qwen3_moe":
        w[p + "self_attn.q_norm.weight"] = r.normal((hd,), 0.1, 1.0)
        w[p + "self_attn.k_norm.weight"] = r.normal((hd,), 0.1, 1.0)
        router, expert, names = p + "mlp.gate.weight", p + "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")
    else:
        router, expert, names = p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")
    w[router] = r.normal((experts, d), 2.0 * d ** -0.5)
    for e in range(experts):
        gate, up, down = (expert.format(e=e) + n + ".weight" for n in names)
        w[gate] = r.normal((inter, d), d ** -0.5)
        w[up] = r.normal((inter, d), d ** -0.5)
        w[down] = r.normal((d, inter), inter ** -0.5)
    return w


def _write_weights(out: Path, cfg: dict, arch: str, r: _Random, dtype: str, progress, rename=None,
                   extra=None, adjust_globals=None, adjust_layer=None, fp8: bool = False) -> None:
    """One safetensors file for a small model; one shard per layer (and an index) for a large one.
    ``rename`` maps the language model's names (a LLaVA layout); ``extra()`` adds more tensors;
    ``adjust_globals`` rewrites the embedding, final norm and unembedding after they are drawn;
    ``adjust_layer(i, tensors)`` a layer's (Qwen3-VL fuses its experts)."""
    def layer_tensors(i):
        drawn = _layer_tensors(cfg, arch, i, r)
        return adjust_layer(i, drawn) if adjust_layer else drawn

    def global_tensors():
        drawn = _global_tensors(cfg, r)
        return adjust_globals(drawn) if adjust_globals else drawn

    def stored(tensors, rename=rename):
        named = {(rename or str)(k): a for k, a in tensors.items()}
        if fp8:  # Qwen's FP8 layout: the layers' projections as e4m3 with block scales
            return fp8_stored(named, is_qwen_fp8_weight)
        if dtype == "bf16":
            return {k: (a if a.dtype == np.uint16 else f32_to_bf16(a), "BF16") for k, a in named.items()}
        return {k: (a, "F32") for k, a in named.items()}

    layers = range(cfg["num_hidden_layers"])
    if PRESET_SHARDED.get(cfg.get("_preset"), False):
        weight_map = {}
        parts = [("model-globals.safetensors", global_tensors)]
        parts += [(f"model-layer-{i:03d}.safetensors", lambda i=i: layer_tensors(i)) for i in layers]
        vision = [("model-vision.safetensors", extra)] if extra else []
        for fname, make in progress(parts + vision):
            tensors = stored(make(), rename if make is not extra else None)
            save_file(tensors, out / fname)
            weight_map.update({name: fname for name in tensors})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return
    tensors = global_tensors()
    for i in layers:
        tensors.update(layer_tensors(i))
    tensors = stored(tensors)
    if extra:
        tensors.update(stored(extra(), None))
    save_file(tensors, out / "model.safetensors")


def init_model(out_dir: str | Path, arch: str = "qwen3_moe", preset: str = "tiny", seed: int = 0,
               dtype: str = "bf16", num_layers: int | None = None, progress=iter,
               num_experts: int | None = None, vision: str | None = None, script: str | None = None,
               experts_dtype: str = "bf16") -> Path:
    """Write a model directory; returns its path. ``dtype``: 'bf16' or 'f32' tensors;
    ``num_layers`` and ``num_experts`` (per MoE layer) override the preset's counts; ``vision``
    ('siglip' or 'clip') wraps the language model in a LLaVA checkpoint with that tower (its weights
    drawn from seed + 1, so the language model's are the same with or without it). ``script``: a
    text that greedy decoding writes after any prompt, then the end of sequence (tiny_script.py:
    its pieces become tokens of their own; every other weight is drawn as without it).
    ``experts_dtype`` 'fp8': an FP8 checkpoint as Qwen publishes one (fp8_checkpoint.py), the same
    draws quantized."""
    if experts_dtype not in ("bf16", "fp8"):
        raise ValueError(f"init-model writes bf16 or fp8 experts, not {experts_dtype!r}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {sorted(PRESETS)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config("qwen3_moe" if arch == "qwen3_vl_moe" else arch, preset)
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    if num_experts:
        key = "num_experts" if "num_experts" in cfg else "num_local_experts"
        if num_experts < cfg["num_experts_per_tok"]:
            raise ValueError(f"{num_experts} experts: fewer than the {cfg['num_experts_per_tok']} active per token")
        cfg[key] = num_experts
    if dtype != "bf16":
        cfg["torch_dtype"] = "float32"
    if arch == "qwen3_vl_moe":  # Qwen3-VL-MoE: its own tower, layout and tokens (common/qwen3vl_tiny.py)
        if vision or script is not None:
            raise ValueError("qwen3_vl_moe has its own vision tower: no --vision (LLaVA) and no script")
        return init_qwen3vl(out, cfg, preset, dtype, progress, _write_weights,
                            _Random(seed, fast=PRESET_SHARDED[preset]), _Random(seed + 1, fast=False))
    tokenizer = train_tokenizer(min(cfg["vocab_size"] - 64, 4096), seed=0, image_token=bool(vision))
    if dtype != "bf16":
        cfg["torch_dtype"] = "float32"
    eos = tokenizer.token_to_id("<|im_end|>")
    cfg["eos_token_id"] = eos
    top = llava_config(cfg, vision, preset, tokenizer.token_to_id(IMAGE_TOKEN)) if vision else cfg
    fast = PRESET_SHARDED[preset]
    adjust = None
    if script is not None:
        if fast:
            raise ValueError(f"a script needs a small preset, not {preset!r}")
        chain = add_script_tokens(tokenizer, script, cfg["vocab_size"], cfg["hidden_size"])
        adjust = partial(scripted_tensors, chain=chain, eos=eos)
    # plain draws even for large presets: a tower is at most ~0.4 G values, and the fast pools (one
    # per distinct scale) would cost more than they save
    extra = (lambda: vision_tensors(top, _Random(seed + 1, fast=False))) if vision else None
    _write_weights(out, {**cfg, "_preset": preset}, arch, _Random(seed, fast=fast), dtype, progress,
                   rename=llava_name if vision else None, extra=extra, adjust_globals=adjust,
                   fp8=experts_dtype == "fp8")
    if experts_dtype == "fp8":
        routers = [f"model.layers.{i}.mlp.gate" for i in range(cfg["num_hidden_layers"])]
        top["quantization_config"] = Fp8Quantization(("lm_head", *routers)).as_config()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(top, indent=2))
    if vision:
        (out / "processor_config.json").write_text(json.dumps(processor_config(top), indent=2))
        (out / "chat_template.jinja").write_text(CHATML_TEMPLATE)  # where transformers' processors look
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": SPECIAL_TOKENS[1:] + ([IMAGE_TOKEN] if vision else []),
        "model_max_length": cfg["max_position_embeddings"],
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [eos, tokenizer.token_to_id("<|endoftext|>")], "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "do_sample": False}, indent=2))
    return out
