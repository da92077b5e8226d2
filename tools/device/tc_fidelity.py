"""On the GPU: long prompts (past the 64-token decode threshold, so the tensor-core path runs) on the
cuda device against transformers in float32 on the CPU, for the fidelity tests' six tiny models, in
each precision and KV cache dtype: max |logit difference| at the last position (prompts of 300, 100,
80 tokens in one step) and greedy tokens after the 100-token prompt. A mode is GEMM/ATTENTION[/KV]:
GEMM split, bf16, f32 or off (no tensor cores: every step runs the decode kernels), ATTENTION split,
f32 or tf32 (MOEBUS_ATTENTION_COMPUTE), KV fp32 (default) or bf16, then optionally "mat": the
materialised attention instead of the fused kernel (MOEBUS_ATTENTION_FLASH=0 for that mode alone).
Usage: tc_fidelity.py ROOT [MODE,...] (models are made in ROOT; FID_MODELS=a,b picks some)"""
import os
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

from moebus.cuda.kernels import flash_attention, prefill_attention
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
MODES = [("split", "split", "fp32", ""), ("split", "f32", "fp32", ""), ("bf16", "split", "fp32", ""),
         ("off", "-", "fp32", "")]
if len(sys.argv) > 2:  # e.g. split/split,off/-,split/split/bf16,split/split/bf16/mat
    MODES = [tuple((m + "/fp32/" if m.count("/") < 2 else m + "/").split("/")[:4]) for m in sys.argv[2].split(",")]
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
    for mode in MODES:
        ours = LocalModel(path, device="cuda", num_slots=4, max_context=512, kv_dtype=mode[2])
        ours.backend.tensor_cores = None if mode[0] == "off" else TensorCores(blas, precision=mode[0])
        prefill_attention.PRECISION = mode[1]
        flash_attention.ENABLED = mode[3] != "mat" and os.environ.get("MOEBUS_ATTENTION_FLASH", "1") != "0"
        diff = max(float(np.abs(row - r).max()) for row, r in zip(ours.prefill_logits(prompts), ref))
        same = ours.generate(prompts[1], 16).tokens == ref_tokens
        worst[mode] = [max(worst[mode][0], diff), worst[mode][1] and same]
        print(f"{name:16s} {mode[0]:5s} attention {mode[1]:4s}{mode[3]:>4s} kv {mode[2]} max|dlogit| {diff:.2e}  "
              f"greedy-16 equal {same}", flush=True)
for mode, (diff, same) in worst.items():
    print(f"FIDELITY gemm {mode[0]:5s} attention {mode[1]:4s}{mode[3]:>4s} kv {mode[2]}: worst |dlogit| {diff:.2e} (bar 1e-3), "
          f"tokens equal {same}")
