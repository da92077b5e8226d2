"""Issue 16, eighth session: bench decode at a layer count where a step is GPU-bound, experts bf16 /
fp8 / int4 and the attention projections bf16 or fp8 (``--attention-dtype``, linear_quant.py), all
resident and in a cache of bf16's 25% MiB, batch 1 and 8. One process, so kernels compile once and
each experts dtype's host store (and each layer's FP8 attention) is built once; one JSON object a
line as each figure comes (a partial log keeps what finished).

    quant8_speed.py MODEL                  (TOKENS, REPEATS, BATCH, CONFIGS from the environment)
    quant8_speed.py --table LOG"""
import contextlib
import io
import json
import os
import sys
import time

from quant7_speed import _keep_stores, _wait_for_tests, emit

# (cache, experts, attention), in the order they run: the unmet ratios first, so that a cut-off run
# still answers them
CONFIGS = [tuple(c.split(":")) for c in os.environ.get("CONFIGS", " ".join([
    "all:bf16:bf16", "all:fp8:fp8", "quarter:bf16:bf16", "quarter:fp8:bf16", "all:int4:fp8", "quarter:fp8:fp8",
    "quarter:int4:fp8", "all:fp8:bf16", "quarter:int4:bf16", "all:int4:bf16"])).split()]
KEYS = ("experts_dtype", "attention_dtype", "batch", "tok_s", "ms_per_step", "us_per_layer", "hit_rate",
        "expert_cache_mib", "cache_frac", "layers", "h2d_gb_s", "h2d_bytes_per_step", "pcie_bound_tok_s")


def _keep_attention() -> None:
    """Each layer's FP8 q/k/v/o quantized once for every run (stage.py calls attention_fp8 per layer)."""
    from moebus.workers import stage

    made = {}

    def attention_fp8(ckpt, layer, tensors):
        key = (str(ckpt.dir), layer)
        if key not in made:
            made[key] = stage_attention(ckpt, layer, tensors)
        return dict(made[key])

    stage_attention = stage.attention_fp8
    stage.attention_fp8 = attention_fp8


def decode(model: str) -> None:
    from moebus.bench.decode import experts_mib, main

    _keep_stores()
    _keep_attention()
    _wait_for_tests()
    quarter_mib = experts_mib(model, "bf16") / 4
    args = ["--model", model, "--device", os.environ.get("DEVICE", "cuda"), "--batch", os.environ.get("BATCH", "1,8"),
            "--tokens", os.environ.get("TOKENS", "32"), "--repeats", os.environ.get("REPEATS", "1"), "--no-service",
            "--json"]
    for cache, experts, attention in CONFIGS:
        began = time.perf_counter()
        out = io.StringIO()
        extra = ["--cache-mib", f"{quarter_mib:.1f}"] if cache == "quarter" else []
        with contextlib.redirect_stdout(out):
            main(args + ["--experts-dtype", experts, "--attention-dtype", attention] + extra)
        for line in out.getvalue().splitlines():
            row = json.loads(line) if line.startswith("{") else {}
            if "tok_s" in row:
                emit({"section": "decode", "cache": "25% of bf16's MiB" if cache == "quarter" else "all resident",
                      "run_s": time.perf_counter() - began, **{k: row.get(k) for k in KEYS}})


def table(rows: list[dict]) -> None:
    for r in (r for r in rows if r["section"] == "load"):
        print(f"host store {r['experts_dtype']}: {r['store_s']:.1f} s ({r['store_gib']:.2f} GiB)")
    decoded = [r for r in rows if r["section"] == "decode"]
    base = {(r["cache"], r["batch"]): r["tok_s"] for r in decoded
            if r["experts_dtype"] == "bf16" and r["attention_dtype"] == "bf16"}
    if decoded:
        print(f"\ncache                 experts attn batch    tok/s  x bf16  us/layer  hit rate  cache MiB  PCIe GB/s "
              f"MB/step  PCIe-bound tok/s ({decoded[0]['layers']} layers)")
    for r in decoded:
        ratio = r["tok_s"] / base[(r["cache"], r["batch"])] if (r["cache"], r["batch"]) in base else float("nan")
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        bound = "-" if not r.get("pcie_bound_tok_s") else f"{r['pcie_bound_tok_s']:.1f}"
        print(f"{r['cache']:21} {r['experts_dtype']:7} {r['attention_dtype']:4} {r['batch']:5} {r['tok_s']:8.1f} "
              f"{ratio:6.2f}x {r['us_per_layer']:8.1f} {hit:>9} {r['expert_cache_mib']:9.1f} {r['h2d_gb_s'] or 0:9.1f} "
              f"{(r['h2d_bytes_per_step'] or 0) / 1e6:8.1f} {bound:>8}")


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        with open(sys.argv[2]) as log:
            table([json.loads(line) for line in log if line.startswith("{")])
        sys.exit(0)
    try:
        decode(sys.argv[1])
    except Exception as e:  # noqa: BLE001 - the rows so far stay in the log
        print(f"decode failed: {type(e).__name__}: {e}", flush=True)
