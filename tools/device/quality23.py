"""Issue 16, twenty-third session (for the next session's call): fidelity on a TRAINED model with heads of 128
(`tools/train_tiny_moe.py --head-dim 128`) of the decode attention taking qkv_rope_store's work
(rope_attention.ENABLED), with bf16 KV caches (the kernel's; the service's default on cuda): `moebus bench quality`'s
measure (top-1 agreement and KL against the bf16 model, each step feeding the held-out text's own next token) at
batch 1, one text at a time, by row: fp8 experts (bf16 attention: the issue's FP8 target), fp8 + FP8 attention, int4 +
FP8 attention, each with it off and on (both models of a row take the same setting, so the pairs of rows say whether
it moves the quantization's figures). Counts
the one kernel's launches, so that a row that never took it says so.

    python3 tools/device/quality23.py MODEL_DIR TEXTS_JSON [PROMPTS] [STEPS]"""
from __future__ import annotations

import json
import sys
import time

ROWS = (("fp8", "bf16", False), ("fp8", "bf16", True), ("fp8", "fp8", False), ("fp8", "fp8", True),
        ("int4", "fp8", False), ("int4", "fp8", True))


def main() -> int:
    from mma19_quality import arguments, count_launches, each_text  # beside this script

    model, texts, steps = arguments(sys.argv)
    from moebus.cuda.kernels import attention_decode_tc, rope_attention

    calls = {"rope": 0}
    count_launches(calls, "rope", attention_decode_tc, "launch_rope")
    for experts, attention, on in ROWS:
        rope_attention.ENABLED = on
        calls["rope"] = 0
        t0 = time.time()
        print(json.dumps({"experts": experts, "attention": attention, "rope_attention": on, "prompts": len(texts),
                          "steps": steps, **each_text(model, texts, steps, experts, attention, kv_dtype="bf16"),
                          "rope_launches": calls["rope"], "s": round(time.time() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
