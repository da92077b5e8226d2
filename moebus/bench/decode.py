"""Decode speed in-process and through the service, and the broker's added latency per step."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

from moebus.bench.beside_prefill import prompt_lengths


def _in_process(model, prompt: list[int], tokens: int, batch: int, repeats: int, launch_ahead: bool = True) -> dict:
    """Greedy decode of ``batch`` sequences after a prompt each (LocalModel.decode: each step
    launched before the one before is read, unless ``launch_ahead`` is off); per-step wall times
    (from one step's tokens on the host to the next's, the host's work included) and the expert
    caches' counters over the timed steps."""
    from moebus.workers.batch import StepBatch

    caches = [s.experts for s in model.stages]
    step_s, before = [], [dict(c.stats()) for c in caches]
    for _ in range(repeats):
        model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(prompt)] * batch,
                             tokens=prompt * batch))
        before = [dict(c.stats()) for c in caches]  # the last repeat's decode is what is counted
        steps = (StepBatch(slots=range(batch), starts=[len(prompt) + i] * batch, lengths=[1] * batch,
                           tokens=[prompt[-1]] * batch) for i in range(tokens))  # then the ids sampled
        start = time.perf_counter()
        for out in model.decode(steps, launch_ahead):
            out.tokens.tolist()  # the ids on the host, as a caller takes them
            now = time.perf_counter()
            step_s.append(now - start)
            start = now
    after = [c.stats() for c in caches]
    counted_s = sum(step_s[-tokens:])
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    misses = sum(a["misses"] - b["misses"] for a, b in zip(after, before))
    h2d = sum(a["h2d_bytes"] - b["h2d_bytes"] for a, b in zip(after, before))
    fetched = {k: sum(a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before))  # the next layer's, ahead
               for k in ("prefetched", "prefetch_used", "prefetch_wasted_bytes")}
    median_s = statistics.median(step_s[tokens:] if repeats > 1 else step_s)  # the first repeat warms up
    return {"batch": batch, "tok_s": batch / median_s, "ms_per_step": median_s * 1e3,
            "hit_rate": hits / max(hits + misses, 1), "h2d_gb_s": h2d / counted_s / 1e9,
            # the PCIe bound counts what the step needs: its misses and admissions, not wasted prefetches
            "h2d_bytes_per_step": (h2d - fetched["prefetch_wasted_bytes"]) / tokens,
            "unique_experts_per_step": (hits + misses) / tokens, "prefetched_per_step": fetched["prefetched"] / tokens,
            "prefetch_used_per_step": fetched["prefetch_used"] / tokens,
            "prefetch_wasted_mb_per_step": fetched["prefetch_wasted_bytes"] / tokens / 1e6}


def _bounds(r: dict, cfg, num_layers: int, blob_bytes: int, pcie_gb_s: float, hbm_gb_s: float) -> dict:
    """What the bytes of one step allow: over PCIe (the measured miss bytes) and over HBM (every
    weight the step reads, the experts counted once per step, as the kernels read them)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attention = (cfg.num_heads * hd * d * 2 + cfg.num_kv_heads * hd * d * 2 + cfg.num_experts * d) * 2
    dense = num_layers * attention + cfg.vocab_size * d * 2
    step_bytes = dense + r["unique_experts_per_step"] * blob_bytes
    pcie_s = r["h2d_bytes_per_step"] / (pcie_gb_s * 1e9)
    return {"pcie_bound_tok_s": r["batch"] / pcie_s if pcie_s else None,
            "hbm_bound_tok_s": r["batch"] / (step_bytes / (hbm_gb_s * 1e9)), "step_gb": step_bytes / 1e9}


def _through_service(model_dir: str | None, device: str, prompt: list[int], tokens: int, repeats: int,
                     batches: list[int], env: dict | None = None) -> dict[int, dict]:
    """Per batch size: greedy tok/s of that many streams at once through a private broker, from the
    first token of every stream to the last token (prefill left out, as in-process), and the
    broker's and the stages' ms per decode step over the same span."""
    from moebus.cli_generate import private_broker
    from moebus.client import Client

    flags = ["--device", device] + (["--model", model_dir] if model_dir else [])
    env = {"MOEBUS_MAX_CONTEXT": str(len(prompt) + tokens + 8), "MOEBUS_MAX_BATCH": str(max(batches)), **(env or {})}
    with private_broker(flags, env=env) as address:
        client = Client(address)
        try:
            out = {}
            for batch in batches:
                runs = [_service_run(client, prompt, tokens, batch) for _ in range(repeats + 1)][1:]  # 1st warms up
                out[batch] = {"tok_s": statistics.median(r[0] for r in runs), "runs": [r[0] for r in runs],
                              "broker_step_ms": statistics.median(r[1][0] for r in runs),
                              "worker_step_ms": statistics.median(r[1][1] for r in runs)}
            out["worker"] = _worker_totals(client)
            return out
        finally:
            client.close()


def _service_run(client, prompt: list[int], tokens: int, batch: int) -> tuple[float, tuple[float, float]]:
    streams = [client.generate(prompt_tokens=prompt, max_tokens=tokens, temperature=0, ignore_eos=True)
               for _ in range(batch)]
    for stream in streams:
        next(stream)  # the prompts' step is done: decode from here
    before, start = client.info(), time.perf_counter()
    n = sum(len(part.tokens) for stream in streams for part in stream)
    elapsed_s = time.perf_counter() - start
    return n / elapsed_s, _step_overhead(before, client.info())


WORKER_INFO_S = 4.5  # the broker asks its workers for INFO every 2 s (4 s while steps run)


def _worker_totals(client) -> dict:
    """The first worker's totals over every run: steps, those launched ahead, cache misses, graphs."""
    time.sleep(WORKER_INFO_S)
    worker = client.info()["gpus"][0]
    return {k: worker.get(k) for k in ("steps", "steps_launched_ahead", "hits", "misses", "cuda_graphs",
                                       "graph_batches")}


def _step_overhead(before: dict, after: dict) -> tuple[float, float]:
    """(ms per step seen by the broker, ms per step computing in the stages) between two INFOs."""
    def delta(name):
        h0, h1 = before["histograms"][name], after["histograms"][name]
        return h1["sum"] - h0["sum"], sum(h1["counts"]) - sum(h0["counts"])

    total_s, steps = delta("step_seconds")
    compute_s, _ = delta("step_compute_seconds")
    return total_s / max(steps, 1) * 1e3, compute_s / max(steps, 1) * 1e3


def experts_mib(model_dir: str, experts_dtype: str) -> float:
    """MiB of all the model's experts stored in ``experts_dtype`` (the host store's blobs)."""
    import numpy as np

    from moebus.common.checkpoint import Checkpoint
    from moebus.common.quant_layout import expert_layout
    from moebus.cuda.dtypes import STORAGE

    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    layout = expert_layout(experts_dtype, d, inter)
    blob_bytes = 3 * d * inter * np.dtype(STORAGE[ckpt.weight_dtype]).itemsize if layout is None else layout.blob_bytes
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) * cfg.num_experts * blob_bytes / 2**20


def cache_fraction_of_mib(model_dir: str, experts_dtype: str, cache_mib: float) -> float:
    """The share of the model's experts, stored in ``experts_dtype``, that ``cache_mib`` MiB hold (at
    most 1): the same MiB holds ~2x the fp8 experts and ~3.5x the int4 ones of bf16."""
    if cache_mib <= 0:
        raise ValueError(f"--cache-mib {cache_mib}: a cache needs a positive size")
    return min(1.0, cache_mib / experts_mib(model_dir, experts_dtype))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moebus bench decode")
    p.add_argument("--model", help="model directory (default: the embedded demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-frac", type=float, help="expert cache as a share of the experts (default: all)")
    p.add_argument("--cache-mib", type=float, help="instead, an expert cache of this many MiB, whatever the experts' "
                                                   "dtype (e.g. bf16's 25%% for fp8 and int4 experts)")
    p.add_argument("--policy", default="freq", help="expert cache policy: freq (default) or lru")
    p.add_argument("--prefetch-slots", type=int, help="the next layer's experts copied ahead per layer where the "
                   "cache is partial (settings experts.prefetch_slots, default 2; 0: none)")
    p.add_argument("--experts-dtype", default="bf16", choices=["bf16", "fp8", "int4"],
                   help="experts quantized at load (in-process; the service reads MOEBUS_EXPERTS__DTYPE)")
    p.add_argument("--attention-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="q/k/v/o projections (in-process; the service reads MOEBUS_ATTENTION__DTYPE)")
    p.add_argument("--lm-head-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="the lm_head (in-process; the service reads MOEBUS_LM_HEAD__DTYPE)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="the in-process KV cache's (auto: as the service's, bf16 on cuda, fp32 on cpu)")
    p.add_argument("--peer", choices=["hf"], help="also time the HF transformers peer in this call")
    p.add_argument("--peer-script", default=".peer/hf_peer.py")
    p.add_argument("--pcie-gb-s", type=float, default=50.0, help="for the PCIe bound (measured on an H200: 49-55)")
    p.add_argument("--hbm-gb-s", type=float, default=4800.0, help="for the HBM bound (H200 datasheet)")
    p.add_argument("--json", action="store_true", help="one JSON object per line and batch size")
    p.add_argument("--no-service", action="store_true")
    p.add_argument("--no-launch-ahead", action="store_true",
                   help="in-process, run each step after the one before has been read (LocalModel.decode)")
    p.add_argument("--pipeline", choices=["on", "off", "both"],
                   help="also: --streams greedy streams on a two-stage split, pipelined or not (both: side by "
                        "side, with the model on one stage)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams for --pipeline")
    p.add_argument("--schema", help="a JSON schema file: also batch 8 through the service with one stream under it "
                                    "vs none (moebus/bench/structured.py)")
    p.add_argument("--beside-prefill", type=prompt_lengths,
                   help="prompt lengths N[,N2]: also 8 streams' inter-token gaps through the service before and "
                        "while one prompt of N tokens prefills (moebus/bench/beside_prefill.py)")
    args = p.parse_args(argv)
    from moebus.common.demo_model import demo_model_dir
    from moebus.workers.kv_cache import resolve_kv_dtype
    from moebus.workers.local import LocalModel

    model_dir = args.model or str(demo_model_dir())
    kv_dtype = resolve_kv_dtype(args.kv_dtype, args.device)  # the service resolves its setting the same way
    prompt = [(7 * i + 3) % 200 + 10 for i in range(args.prompt_tokens)]
    batches = [int(b) for b in args.batch.split(",")]
    if args.cache_mib is not None:
        if args.cache_frac is not None:
            p.error("--cache-frac or --cache-mib, not both")
        args.cache_frac = cache_fraction_of_mib(model_dir, args.experts_dtype, args.cache_mib)
    prefetch = {} if args.prefetch_slots is None else {"prefetch_slots": args.prefetch_slots}  # else LocalModel's
    model = LocalModel(model_dir, device=args.device, num_slots=max(batches), cache_fraction=args.cache_frac,
                       max_context=len(prompt) + args.tokens + 8, policy=args.policy, experts_dtype=args.experts_dtype,
                       kv_dtype=kv_dtype, attention_dtype=args.attention_dtype,
                       lm_head_dtype=args.lm_head_dtype, **prefetch)
    cfg, store = model.ckpt.config, model.stages[0].experts.store
    common = {"model": Path(model_dir).name, "device": args.device, "layers": cfg.num_layers,
              "experts": cfg.num_experts, "cache_frac": args.cache_frac or 1.0, "policy": args.policy,
              "experts_dtype": args.experts_dtype, "attention_dtype": args.attention_dtype,
              "lm_head_dtype": args.lm_head_dtype, "kv_dtype": kv_dtype,
              "expert_cache_mib": model.stages[0].experts.arena.mapped_bytes / 2**20,
              "graphs": any(s.use_graphs for s in model.stages), "launch_ahead": not args.no_launch_ahead,
              "prefetch_slots": sum(s.experts.num_reserved for s in model.stages) // 2}  # 0: none ran
    rows = []
    for batch in batches:
        r = _in_process(model, prompt, args.tokens, batch, args.repeats, not args.no_launch_ahead)
        r.update(_bounds(r, cfg, cfg.num_layers, store.blob_bytes, args.pcie_gb_s, args.hbm_gb_s))
        r["us_per_layer"] = r["ms_per_step"] * 1e3 / cfg.num_layers
        rows.append({**common, **r})
    del model
    with _service_env(MOEBUS_KV_DTYPE=kv_dtype):  # the private brokers below run the same KV cache
        extra = _peer_and_service(args, cfg, prompt, batches, rows)
    _print(rows, extra, args.json)
    return 0


@contextlib.contextmanager
def _service_env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _peer_and_service(args, cfg, prompt: list[int], batches: list[int], rows: list[dict]) -> dict:
    extra = {}
    if args.peer == "hf":
        from moebus.bench.peer import hf_peer_tok_s

        extra["hf_peer_batch1_tok_s"] = hf_peer_tok_s(args.peer_script, cfg.num_layers)
    if not args.no_service:
        extra.update(_service_figures(_through_service(args.model, args.device, prompt, args.tokens, args.repeats,
                                                       batches), rows))
    if args.pipeline:
        from moebus.bench.pipeline import compare

        extra.update(compare(args.model, args.device, prompt, args.tokens, args.streams, args.repeats, args.pipeline))
    if args.schema:
        from moebus.bench.structured import compare as schema_compare

        extra.update(schema_compare(args.model, args.device, prompt, args.tokens, args.schema, args.repeats))
    if args.beside_prefill:
        from moebus.bench.beside_prefill import compare as beside_compare

        extra.update(beside_compare(args.model, args.device, args.beside_prefill))
    return extra


def _service_figures(service: dict[int, dict], rows: list[dict]) -> dict:
    """Per batch size: tok/s through the service, its share of in-process (issue 15's goal: >= 0.95 at
    batch 1), ms per step as the broker and as the stage see it, and the broker's hop between them."""
    extra, in_process = {}, {r["batch"]: r["tok_s"] for r in rows}
    extra.update({f"service_worker_{k}": v for k, v in service.pop("worker").items()})
    for batch, s in service.items():
        extra[f"service_batch{batch}_tok_s"] = s["tok_s"]
        extra[f"service_batch{batch}_share_of_in_process"] = s["tok_s"] / in_process[batch]
        extra[f"service_batch{batch}_step_ms"] = s["broker_step_ms"]
        extra[f"worker_batch{batch}_step_ms"] = s["worker_step_ms"]
        extra[f"broker_batch{batch}_added_ms_per_step"] = s["broker_step_ms"] - s["worker_step_ms"]
    return extra


def _print(rows: list[dict], extra: dict, as_json: bool) -> None:
    if as_json:
        for r in rows:
            print(json.dumps({**r, **extra}))
        return
    head = ("batch", "tok_s", "ms_per_step", "us_per_layer", "hit_rate", "h2d_gb_s", "pcie_bound_tok_s",
            "hbm_bound_tok_s")
    first = rows[0]
    print(" ".join(f"{k}={first[k]}" for k in ("model", "device", "layers", "experts", "cache_frac", "policy", "graphs", "launch_ahead",
                                               "experts_dtype", "attention_dtype", "lm_head_dtype", "kv_dtype",
                                               "expert_cache_mib",
                                               "prefetch_slots")))
    print("  ".join(f"{h:>16}" for h in head))
    for r in rows:
        print("  ".join(f"{_fmt(r[h]):>16}" for h in head))
    for r in rows:
        if r["prefetched_per_step"]:
            print(f"batch {r['batch']} prefetch: {_fmt(r['prefetched_per_step'])} experts a step, "
                  f"{_fmt(r['prefetch_used_per_step'])} used, {_fmt(r['prefetch_wasted_mb_per_step'])} MB wasted")
    for key, value in extra.items():
        print(f"{key:<28}  {_fmt(value)}")


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) and abs(value) < 10 else (
        f"{value:.1f}" if isinstance(value, float) else str(value))
