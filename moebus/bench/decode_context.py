"""Decode speed at long contexts, per KV cache dtype (issue 15: decode at 32k context with a bf16 KV
cache >= 0.7x decode at 1k).

    moebus bench decode-context --model DIR --device cuda --contexts 1024,4096,32768 --kv-dtype bf16,fp32

One model per KV dtype, sized for the longest context; at each context, greedy decode of one
sequence whose tokens sit at positions context, context + 1, ... so that every step's attention
reads that many cache positions per layer. The positions before the context are never written
(zeros): attention reads their bytes all the same, which is what the figure is about, and no
prompt of 32k tokens has to be prefilled first. Per row: tok/s, ms per step, the KV bytes one
step reads and the share of 1k's tok/s (or the shortest context asked)."""
from __future__ import annotations

import argparse
import json
import statistics
import time


def decode_at(model, context: int, tokens: int, repeats: int) -> float:
    """Median seconds per greedy decode step of one sequence at positions context, context + 1, ..."""
    from moebus.workers.batch import StepBatch

    step_s = []
    for _ in range(repeats + 1):  # the first pass warms up (kernels, the decode graph)
        last, times = [7], []
        for i in range(tokens):
            start = time.perf_counter()
            out = model.step(StepBatch(slots=[0], starts=[context + i], lengths=[1], tokens=last))
            times.append(time.perf_counter() - start)
            last = [int(t) for t in out.tokens]
        step_s.append(times)
    return statistics.median(t for times in step_s[1:] for t in times)


def kv_bytes_per_step(cfg, context: int, kv_dtype: str) -> int:
    """K and V of ``context`` positions, every layer, as the decode kernel reads them."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * context * cfg.head_dim * (2 if kv_dtype == "bf16" else 4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench decode-context")
    p.add_argument("--model", help="model directory (default: the embedded demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--contexts", default="1024,4096,32768", help="positions each step's attention reads")
    p.add_argument("--kv-dtype", default="bf16,fp32", help="KV cache dtypes to compare (bf16, fp32)")
    p.add_argument("--tokens", type=int, default=32, help="decode steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from moebus.common.demo_model import demo_model_dir
    from moebus.workers.local import LocalModel

    model_dir = args.model or str(demo_model_dir())
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for kv_dtype in args.kv_dtype.split(","):
        model = LocalModel(model_dir, device=args.device, num_slots=1, max_context=max(contexts) + args.tokens + 8,
                           kv_dtype=kv_dtype)
        cfg = model.ckpt.config
        for context in contexts:
            step_s = decode_at(model, context, args.tokens, args.repeats)
            rows.append({"kv_dtype": kv_dtype, "context": context, "tok_s": 1 / step_s, "ms_per_step": step_s * 1e3,
                         "kv_gb_per_step": kv_bytes_per_step(cfg, context, kv_dtype) / 1e9,
                         "layers": cfg.num_layers, "experts": cfg.num_experts, "device": args.device})
        del model
    for r in rows:
        first = next(x for x in rows if x["kv_dtype"] == r["kv_dtype"])
        r["share_of_shortest"] = r["tok_s"] / first["tok_s"]
    _print(rows, args.json)
    return 0


def _print(rows: list[dict], as_json: bool) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"device={rows[0]['device']} layers={rows[0]['layers']} experts={rows[0]['experts']} batch=1")
    head = ("kv_dtype", "context", "tok_s", "ms_per_step", "kv_gb_per_step", "share_of_shortest")
    print("  ".join(f"{h:>17}" for h in head))
    for r in rows:
        print("  ".join(f"{r[h]:>17.3f}" if isinstance(r[h], float) else f"{r[h]:>17}" for h in head))
