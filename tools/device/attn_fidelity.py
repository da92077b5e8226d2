"""On the GPU: the fidelity tests' six tiny models on cuda against transformers in float32 on the
CPU, per KV cache dtype, with the tensor-core path of long steps (split precision) and without it
(every step then runs the decode attention kernel): max |logit difference| at the last position of
prompts of 300, 100 and 80 tokens in one step, and greedy tokens after the 100-token prompt.
Usage: attn_fidelity.py ROOT (models are made in ROOT)"""
import os
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

from moebus.cuda.kernels.gemm import TensorCores
from moebus.cuda.kernels.gemm_host import cublas_blas
from moebus.workers.local import LocalModel
from tests.models import hf_greedy, make_hf_model, make_init_model

root = Path(sys.argv[1])
MODELS = {"init_qwen3": lambda p: make_init_model(p, "qwen3_moe"), "init_mixtral": lambda p: make_init_model(p, "mixtral"),
          "hf_qwen3_bf16": lambda p: make_hf_model(p, "qwen3_moe", "bf16"),
          "hf_qwen3_f32": lambda p: make_hf_model(p, "qwen3_moe", "f32"),
          "hf_mixtral_bf16": lambda p: make_hf_model(p, "mixtral", "bf16"),
          "hf_mixtral_f16": lambda p: make_hf_model(p, "mixtral", "f16")}
if os.environ.get("FID_MODELS"):  # a comma-separated subset
    MODELS = {name: MODELS[name] for name in os.environ["FID_MODELS"].split(",")}
MODES = [("fp32", "split"), ("fp32", "off"), ("bf16", "split"), ("bf16", "off")]  # (kv dtype, long steps)
rng = np.random.default_rng(0)
worst = {mode: [0.0, True] for mode in MODES}
blas = cublas_blas()
for name, make in MODELS.items():
    path = root / name
    if not (path / "config.json").exists():
        make(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    prompts = [[int(t) for t in rng.integers(3, vocab - 1, n)] for n in (300, 100, 80)]
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).logits[0, -1].numpy() for p in prompts]
    ref_tokens = hf_greedy(hf, prompts[1], 16)
    for kv_dtype, long_steps in MODES:
        ours = LocalModel(path, device="cuda", num_slots=4, max_context=512, kv_dtype=kv_dtype)
        ours.backend.tensor_cores = None if long_steps == "off" else TensorCores(blas, precision=long_steps)
        diff = max(float(np.abs(row - r).max()) for row, r in zip(ours.prefill_logits(prompts), ref))
        same = ours.generate(prompts[1], 16).tokens == ref_tokens
        mode = (kv_dtype, long_steps)
        worst[mode] = [max(worst[mode][0], diff), worst[mode][1] and same]
        print(f"{name:16s} kv {kv_dtype} tensor cores {long_steps:5s} max|dlogit| {diff:.2e}  greedy-16 equal {same}",
              flush=True)
for (kv_dtype, long_steps), (diff, same) in worst.items():
    print(f"FIDELITY kv {kv_dtype} tensor cores {long_steps:5s}: worst |dlogit| {diff:.2e} (bar 1e-3), tokens equal {same}")
