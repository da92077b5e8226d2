"""Issue 16, twentieth session: fidelity on a TRAINED model (tools/train_tiny_moe.py's) of the o projection starting
the routing (linear_quant_mma.ROUTE, FP8 attention on tensor cores) and of the FP8 lm_head (lm_head.dtype fp8):
`moebus bench quality`'s measure (top-1 agreement and KL against the bf16 model, each step feeding the held-out
text's own next token) at batch 1, one prompt at a time (the b1 tensor-core kernels' batch), by row:
fp8 / int4 experts + FP8 attention with ROUTE off and on; bf16 experts and attention with the FP8 lm_head; int4 +
FP8 attention + FP8 lm_head. Counts the ROUTE launches so that a row that never took them says so.

    python3 tools/device/quality20.py MODEL_DIR TEXTS_JSON [PROMPTS] [STEPS]     (DEVICE=cpu: a dry run)"""
from __future__ import annotations

import json
import sys
import time

ROWS = (("fp8", "fp8", "bf16", False), ("fp8", "fp8", "bf16", True), ("int4", "fp8", "bf16", False),
        ("int4", "fp8", "bf16", True), ("bf16", "bf16", "fp8", True), ("int4", "fp8", "fp8", True))


def main() -> int:
    from mma19_quality import arguments, count_launches, each_text  # beside this script

    model, texts, steps = arguments(sys.argv)
    from moebus.cuda.kernels import linear_quant_mma

    calls = {"route": 0}
    count_launches(calls, "route", linear_quant_mma, "launch_route")
    for experts, attention, lm_head, route in ROWS:
        linear_quant_mma.ROUTE = route
        calls["route"], t0 = 0, time.time()
        print(json.dumps({"experts": experts, "attention": attention, "lm_head": lm_head, "route": route,
                          "prompts": len(texts), "steps": steps,
                          **each_text(model, texts, steps, experts, attention, lm_head),
                          "route_launches": calls["route"], "s": round(time.time() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
