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
    model, texts_path = sys.argv[1], sys.argv[2]
    prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    from moebus.cuda.kernels import linear_quant_mma
    from mma19_quality import each_text  # beside this script

    calls = [0]
    real = linear_quant_mma.launch_route

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)
    linear_quant_mma.launch_route = counted
    texts = json.loads(open(texts_path, encoding="utf-8").read())[:prompts]
    for experts, attention, lm_head, route in ROWS:
        linear_quant_mma.ROUTE = route
        calls[0], t0 = 0, time.time()
        print(json.dumps({"experts": experts, "attention": attention, "lm_head": lm_head, "route": route,
                          "prompts": len(texts), "steps": steps,
                          **each_text(model, texts, steps, experts, attention, lm_head),
                          "route_launches": calls[0], "s": round(time.time() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
