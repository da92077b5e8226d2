"""Issue 16, twenty-second session: fidelity on a TRAINED model (tools/train_tiny_moe.py's) of the down GEMV ending in
the combine and the q|k|v GEMV normalizing its x (moe_quant_mma.COMBINE, quantized experts and FP8 attention on tensor
cores): `moebus bench quality`'s measure (top-1 agreement and KL against the bf16 model, each step feeding the held-out
text's own next token) at batch 1, one prompt at a time, by row: fp8 / int4 experts + FP8 attention with COMBINE off
and on; int4 + FP8 attention + FP8 lm_head with it on. Counts the COMBINE and NORMED launches, so that a row that
never took them says so.

    python3 tools/device/quality22.py MODEL_DIR TEXTS_JSON [PROMPTS] [STEPS]"""
from __future__ import annotations

import json
import sys
import time

ROWS = (("fp8", "fp8", "bf16", False), ("fp8", "fp8", "bf16", True), ("int4", "fp8", "bf16", False),
        ("int4", "fp8", "bf16", True), ("int4", "fp8", "fp8", True))


def main() -> int:
    from mma19_quality import arguments, count_launches, each_text  # beside this script

    model, texts, steps = arguments(sys.argv)
    from moebus.cuda.kernels import linear_quant_mma, moe_quant_mma

    calls = {"combine": 0, "normed": 0}
    count_launches(calls, "combine", moe_quant_mma, "launch_down_combine")
    count_launches(calls, "normed", linear_quant_mma, "launch_normed")
    for experts, attention, lm_head, combine in ROWS:
        moe_quant_mma.COMBINE = combine
        calls.update(combine=0, normed=0)
        t0 = time.time()
        print(json.dumps({"experts": experts, "attention": attention, "lm_head": lm_head, "combine": combine,
                          "prompts": len(texts), "steps": steps,
                          **each_text(model, texts, steps, experts, attention, lm_head),
                          "combine_launches": calls["combine"], "normed_launches": calls["normed"],
                          "s": round(time.time() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
