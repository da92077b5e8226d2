"""Quantized experts' decode speed on one GPU, in one process (the kernels compile once):

1. ``kernels``: the expert FFN (gate|up then down) with bf16 / fp8 / int4 experts at A3B shapes (D 2048,
   I 768), 8 experts a token of 32, 1 and 8 tokens: median GPU us of 30 launches and the experts'
   bytes over it (GB/s).
2. ``decode``: ``moebus bench decode`` (in-process, CUDA graphs) on MODEL for each experts dtype, every
   expert resident and then a cache of bf16's 25% in MiB (``--cache-mib``) for every dtype.
3. ``variants``: as 1 at 1 token, fp8 / int4 with (gate|up rows a warp, words a lane a round) of
   (1, 8) (then the defaults; moe_quant.GATE_UP_SHORT's rows and words now), (2, 4), (1, 4). (4-byte
   words were measured with the second call's tree, 2026-12-01, then dropped: docs/performance.md.)
4. ``profile``: as 1, each kernel's own GPU time (torch.profiler's CUPTI trace of 20 calls): gate|up
   and down apart, without the launch gaps that 1's events include.

One JSON object a line on stdout as each figure comes. Usage:
    quant_speed.py MODEL [kernels] [decode] [variants] [profile]   (DTYPES, BATCH, TOKENS, REPEATS, DEVICE from
                                                                    the environment)
    quant_speed.py --table LOG                            (the table of a log's JSON lines)"""
import contextlib
import io
import json
import os
import sys
import time

import numpy as np

DTYPES = tuple(os.environ.get("DTYPES", "bf16,fp8,int4").split(","))
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 32, 8


def emit(row: dict) -> dict:
    print(json.dumps(row), flush=True)
    return row


def _arena(dtype: str, rng):
    """32 experts' blobs: random codes (scales 0.01) or random bf16 bits; timing does not read values."""
    from moebus.common.quant_layout import expert_layout

    layout = expert_layout(dtype, HIDDEN, INTER)
    if layout is None:
        bits = (rng.standard_normal((EXPERTS, 3 * HIDDEN * INTER), dtype=np.float32).view(np.uint32) >> 16)
        return layout, bits.astype(np.uint16)
    blobs = rng.integers(0, 256, (EXPERTS, layout.blob_bytes), dtype=np.uint8)
    for blob in blobs:
        for _, scales in layout.parts(blob):
            scales[...] = 0.01
    return layout, blobs


def _cases(rng, tokens_list=(1, 8)):
    """(dtype, tokens, bytes read, run) for each experts dtype and token count: one expert FFN call."""
    from moebus.cuda.kernels import moe_ffn, moe_quant
    from moebus.cuda.kernels.compat import cuda

    stream = cuda.stream()
    for dtype in DTYPES:
        layout, blobs = _arena(dtype, rng)
        arena = cuda.to_device(blobs)
        for tokens in tokens_list:
            chosen = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]).ravel()
            order = np.argsort(chosen, kind="stable")  # pairs sorted by slot, as the stage sorts them
            tables = [cuda.to_device(a.astype(np.int32)) for a in (order // TOP_K, chosen[order], order)]
            x = cuda.to_device(rng.standard_normal((tokens, HIDDEN), dtype=np.float32))
            out = cuda.device_array((tokens * TOP_K, HIDDEN), np.float32)
            scratch = cuda.device_array((tokens * TOP_K, INTER), np.float32)

            def run(x=x, tables=tables, arena=arena, out=out, scratch=scratch, layout=layout):
                if layout is None:
                    moe_ffn.expert_ffn_cuda(x, *tables, arena, HIDDEN, INTER, out, scratch, stream=stream)
                else:
                    moe_quant.expert_ffn_quant_cuda(x, *tables, arena, layout, out, scratch, stream=stream)
            yield dtype, tokens, len(np.unique(chosen)) * blobs.shape[1] * blobs.itemsize, run, stream


def profile() -> list[dict]:
    from torch.profiler import ProfilerActivity, profile as trace  # CUPTI: numba's kernels too

    rows = []
    for dtype, tokens, nbytes, run, stream in _cases(np.random.default_rng(0)):
        run()
        stream.synchronize()
        with trace(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                run()
            stream.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        gate_up = [e.device_time for e in kernels[0::2]]  # launch order: gate|up, then down
        down = [e.device_time for e in kernels[1::2]]
        rows.append(emit({"section": "profile", "experts_dtype": dtype, "tokens": tokens, "mb": nbytes / 1e6,
                          "gate_up_us": float(np.median(gate_up)), "down_us": float(np.median(down)),
                          "names": sorted({e.name[-24:] for e in kernels})}))
    return rows


def kernels(variants: bool = False) -> list[dict]:
    from moebus.bench.kernels import time_launches
    from moebus.cuda.kernels import moe_quant

    rows = []
    for dtype, tokens, nbytes, run, stream in _cases(np.random.default_rng(0), (1,) if variants else (1, 8)):
        if variants and dtype == "bf16":
            continue
        default = moe_quant.GATE_UP_SHORT[dtype]
        for shape in ((1, 8), (2, 4), (1, 4)) if variants else (default,):
            moe_quant.GATE_UP_SHORT = {**moe_quant.GATE_UP_SHORT, dtype: shape}
            us = time_launches(run, 30, 3, stream)[0]
            moe_quant.GATE_UP_SHORT = {**moe_quant.GATE_UP_SHORT, dtype: default}
            rows.append(emit({"section": "kernels", "experts_dtype": dtype, "tokens": tokens,
                              "shape": None if dtype == "bf16" else list(shape), "us": us, "mb": nbytes / 1e6,
                              "gb_s": nbytes / us / 1e3}))
    return rows


def decode(model: str) -> list[dict]:
    from moebus.bench.decode import experts_mib, main

    quarter_mib = experts_mib(model, "bf16") / 4
    args = ["--model", model, "--device", os.environ.get("DEVICE", "cuda"), "--batch", os.environ.get("BATCH", "1,8"),
            "--tokens", os.environ.get("TOKENS", "64"), "--repeats", os.environ.get("REPEATS", "2"), "--no-service",
            "--json"]
    rows = []
    for cache in ([], ["--cache-mib", f"{quarter_mib:.1f}"]):
        for dtype in DTYPES:
            began = time.perf_counter()
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                main(args + ["--experts-dtype", dtype] + cache)
            for line in out.getvalue().splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    rows.append(emit({"section": "decode", "cache": "25% of bf16's MiB" if cache else "all resident",
                                      "run_s": time.perf_counter() - began,
                                      **{k: row[k] for k in ("experts_dtype", "batch", "tok_s", "ms_per_step",
                                                             "us_per_layer", "hit_rate", "expert_cache_mib",
                                                             "cache_frac", "layers")}}))
    return rows


def table(rows: list[dict]) -> None:
    print("\nexperts  tokens  g|u rows, words     us     MB   GB/s   (expert FFN, A3B shapes, 8 of 32 a token)")
    for r in (r for r in rows if r["section"] == "kernels"):
        print(f"{r['experts_dtype']:7} {r['tokens']:6} {str(r.get('shape')):>23} {r['us']:6.1f} {r['mb']:6.1f} "
              f"{r['gb_s']:6.0f}")
    for r in (r for r in rows if r["section"] == "profile"):
        print(f"profile {r['experts_dtype']:5} T={r['tokens']}: gate|up {r['gate_up_us']:6.1f} us, down "
              f"{r['down_us']:6.1f} us, {r['mb'] / (r['gate_up_us'] + r['down_us']) * 1e3:5.0f} GB/s")
    decoded = [r for r in rows if r["section"] == "decode"]
    base = {(r["cache"], r["batch"]): r["tok_s"] for r in decoded if r["experts_dtype"] == "bf16"}
    if decoded:
        print(f"\ncache                 experts batch    tok/s  x bf16  us/layer  hit rate  cache MiB  share "
              f"({decoded[0]['layers']} layers)")
    for r in decoded:
        ratio = r["tok_s"] / base[(r["cache"], r["batch"])] if (r["cache"], r["batch"]) in base else float("nan")
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        print(f"{r['cache']:21} {r['experts_dtype']:7} {r['batch']:5} {r['tok_s']:8.1f} {ratio:6.2f}x "
              f"{r['us_per_layer']:8.1f} {hit:>9} {r['expert_cache_mib']:9.1f} {r['cache_frac']:6.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        with open(sys.argv[2]) as log:
            table([json.loads(line) for line in log if line.startswith("{")])
        sys.exit(0)
    model, sections = sys.argv[1], sys.argv[2:] or ["kernels", "decode", "variants"]
    for name in sections:
        try:
            {"kernels": kernels, "decode": lambda: decode(model), "variants": lambda: kernels(True),
             "profile": profile}[name]()
        except Exception as e:  # noqa: BLE001 - one section's failure leaves the other's figures
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
