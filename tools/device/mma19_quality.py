"""The tensor-core GEMVs' fidelity on a TRAINED model (issue 16; nineteenth session): `moebus bench quality`'s
measure (top-1 agreement and KL against the bf16 model, each step feeding the held-out text's own next token) at
batch 1 — the only batch the b1 tensor-core kernels take — one prompt at a time, with MOEBUS_QUANT_MMA off and on
(every format, the projections' weights before the PDL wait), fp8 and int4 experts, FP8 attention projections.
Counts the tensor-core launches so that a row that never took them says so.

    python3 tools/device/mma19_quality.py MODEL_DIR TEXTS_JSON [PROMPTS] [STEPS]

DEVICE=cpu: a dry run of the plumbing (no tensor cores). MODEL_DIR: tools/train_tiny_moe.py's trained bf16 model; TEXTS_JSON: its held_out_texts.json."""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def main() -> int:
    model, texts, steps = arguments(sys.argv)
    from moebus.cuda.kernels import linear_quant_fp8, linear_quant_mma, moe_quant_mma

    calls = {"experts": 0, "attn": 0}
    count_launches(calls, "experts", moe_quant_mma)
    count_launches(calls, "attn", linear_quant_mma)
    for dtype in ("fp8", "int4"):
        for on in (False, True):
            moe_quant_mma.FORMATS = frozenset({dtype, "attn"} if on else ())
            linear_quant_fp8.LOAD_BEFORE_WAIT = on
            calls.update(experts=0, attn=0)
            t0 = time.time()
            print(json.dumps({"experts": dtype, "attention": "fp8", "mma": on, "prompts": len(texts), "steps": steps,
                              **each_text(model, texts, steps, dtype, "fp8"), "mma_launches": dict(calls),
                              "s": round(time.time() - t0, 1)}), flush=True)
    return 0


def arguments(argv) -> tuple[str, list, int]:
    """MODEL_DIR TEXTS_JSON [PROMPTS] [STEPS] -> (MODEL_DIR, the first PROMPTS (4) texts, STEPS (128)); also
    quality20/22/23.py's."""
    model, texts_path = argv[1], argv[2]
    prompts = int(argv[3]) if len(argv) > 3 else 4
    steps = int(argv[4]) if len(argv) > 4 else 128
    return model, json.loads(open(texts_path, encoding="utf-8").read())[:prompts], steps


def count_launches(calls: dict, key: str, module, name: str = "launch") -> None:
    """``module.name`` replaced by the same function adding 1 to ``calls[key]`` a call (a row that never took a
    kernel says so); also quality20/22/23.py's."""
    real = getattr(module, name)

    def counted(*a, **k):
        calls[key] += 1
        return real(*a, **k)
    setattr(module, name, counted)


def each_text(model, texts, steps, experts, attention, lm_head="bf16", kv_dtype="fp32") -> dict:
    """bench quality's measure of each text alone (batch 1, following the text; both models' KV caches in
    ``kv_dtype``), pooled over the texts: comparisons, top1_agreement, mean_kl (also quality20/22/23.py's)."""
    from moebus.bench import quality

    agree, kl, n = [], [], 0
    for text in texts:
        r = quality.measure(model, experts, steps, 1, os.environ.get("DEVICE", "cuda"), attention, [text],
                            follow_text=True, lm_head_dtype=lm_head, kv_dtype=kv_dtype)
        agree.append(r["top1_agreement"] * r["comparisons"])
        kl.append(r["mean_kl"] * r["comparisons"])
        n += r["comparisons"]
    return {"comparisons": n, "top1_agreement": round(float(np.sum(agree) / n), 4), "mean_kl": float(np.sum(kl) / n)}


if __name__ == "__main__":
    sys.exit(main())
