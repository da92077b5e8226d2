"""``moebus bench prefill``: one prompt of T tokens in one step (``LocalModel.step``), tok/s and the
TFLOP/s that the step's matrix work amounts to, per length, from the median of ``--repeats`` runs
after a warm-up (the fastest run and every run's seconds beside it); ``--peer hf`` times HF transformers'
forward over the same checkpoint and lengths in the same call (bench/prefill_peer.py)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def prefill_flops(cfg, num_tokens: int) -> float:
    """Multiply-adds x 2 of a prefill of ``num_tokens``: projections, router, the active experts (or
    dense MLPs), causal attention (scores and values), and the last token's lm_head."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attention_proj = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * d
    per_token = 0
    for i in range(cfg.num_layers):
        mlp = (d * cfg.num_experts + cfg.top_k * 3 * d * cfg.moe_intermediate_size) if cfg.is_moe_layer(i) \
            else 3 * d * cfg.intermediate_size
        per_token += attention_proj + mlp
    attention = cfg.num_layers * 2 * cfg.num_heads * hd * num_tokens * (num_tokens + 1) / 2
    return 2.0 * (per_token * num_tokens + attention + d * cfg.vocab_size)


def bench_prompt(num_tokens: int, vocab: int) -> list[int]:
    return [(7 * i + 3) % (vocab - 10) + 10 for i in range(num_tokens)]


def prefill_times(model, prompt: list[int], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` prefills of ``prompt`` in one step, after one that warms up
    (kernels, scratch, the cuBLAS handle; with a partial cache, the experts the last layers left)."""
    from moebus.workers.batch import StepBatch

    batch = StepBatch(slots=[0], starts=[0], lengths=[len(prompt)], tokens=prompt)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model.step(batch)
        times.append(time.perf_counter() - start)
    return times[1:]


def _time_prefill(model, num_tokens: int, repeats: int) -> dict:
    """The median (the figure), the fastest and every run, in seconds."""
    times = prefill_times(model, bench_prompt(num_tokens, model.ckpt.config.vocab_size), repeats)
    return {"seconds": statistics.median(times), "seconds_min": min(times), "runs": [round(t, 4) for t in times]}


def _peer(model_dir: str, lengths: list[int], repeats: int) -> dict[int, float]:
    """Seconds per prefill of HF transformers (bf16, on the GPU), by length; {} when it did not run."""
    cmd = [sys.executable, "-m", "moebus.bench.prefill_peer", model_dir, ",".join(map(str, lengths)), str(repeats)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"hf peer did not run: {e}", file=sys.stderr)
        return {}
    if run.returncode != 0:
        print(f"hf peer failed (exit {run.returncode}): {run.stderr[-2000:]}", file=sys.stderr)
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {r["tokens"]: r["seconds"] for r in rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench prefill")
    p.add_argument("--model", help="model directory (default: the embedded demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", default="512,2048,8192", help="prompt lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-frac", type=float, help="expert cache as a share of the experts (default: all)")
    p.add_argument("--peer", choices=["hf"], help="also time HF transformers on the same checkpoint")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="the KV cache's (auto: as the service, bf16 on cuda, fp32 on cpu)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from moebus.common.demo_model import demo_model_dir
    from moebus.workers.kv_cache import resolve_kv_dtype
    from moebus.workers.local import LocalModel

    model_dir = args.model or str(demo_model_dir())
    lengths = [int(t) for t in args.tokens.split(",")]
    kv_dtype = resolve_kv_dtype(args.kv_dtype, args.device)
    model = LocalModel(model_dir, device=args.device, num_slots=1, max_context=max(lengths) + 8,
                       cache_fraction=args.cache_frac, kv_dtype=kv_dtype)
    cfg = model.ckpt.config
    tensor_cores = getattr(model.backend, "tensor_cores", None)
    rows = [{"tokens": n, **_time_prefill(model, n, args.repeats), "tflop": prefill_flops(cfg, n) / 1e12}
            for n in lengths]
    del model
    peer = _peer(model_dir, lengths, args.repeats) if args.peer == "hf" else {}
    print(f"model={Path(model_dir).name} device={args.device} layers={cfg.num_layers} experts={cfg.num_experts} "
          f"cache_frac={args.cache_frac or 1.0} kv_dtype={kv_dtype} tensor_cores={tensor_cores.precision if tensor_cores else None}")
    for r in rows:
        r.update(tok_s=r["tokens"] / r["seconds"], tflop_s=r["tflop"] / r["seconds"],
                 best_tok_s=r["tokens"] / r["seconds_min"])
        if r["tokens"] in peer:
            r.update(hf_seconds=peer[r["tokens"]], hf_tok_s=r["tokens"] / peer[r["tokens"]])
        print(json.dumps(r) if args.json else "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                        for k, v in r.items()))
    return 0
