"""Issue 16, sixteenth session (branch quant16): quant15_bench.py's sweep at 48 layers (per (experts, attention)
one load quantized at load, per setting the decode graphs recaptured, tok/s all resident, CUPTI us a kernel, the
greedy ids and log p), then, while time is left, bench decode at a cache of bf16's 25% MiB (batch 1 and 8) for
bf16, fp8 (+ fp8 attention) and int4 (+ fp8 attention) in the same process: each dtype's host store is the
sweep's (quant7_speed._keep_stores), so a cache run costs its upload and graphs only.

    quant16_bench.py MODEL PLAN.json [PROFILE_STEPS]   (quant9_sweep.py's arguments; QUICK=1: a warm-up)
        CACHE_BY=EPOCH_S: start a 25%-MiB run only before then (unset: none); CACHE_DTYPES (fp8,int4,bf16: the
        quantized first; without bf16's run the ratio is against the fifteenth session's call B, BF16_QUARTER)
    quant16_bench.py --summary LOG                     (quant15_bench's summary, then the 25%-MiB rows)"""
import contextlib
import io
import json
import os
import sys
import time

import quant9_sweep
import quant15_bench

ATTENTION = {"bf16": "bf16", "fp8": "fp8", "int4": "fp8"}  # the sweep's attention dtype for each experts dtype
# bf16 at a 25% cache, 48 x 32, tok/s by batch (fifteenth session, call B: bench decode --cache-frac 0.25)
BF16_QUARTER = {1: 42.5, 8: 317.5}


def quarter_cache(model: str, deadline_s: float) -> None:
    """bench decode (in process, all its own timing) at bf16's 25% MiB for each CACHE_DTYPES, batch 1 and 8,
    each started only before ``deadline_s`` (epoch seconds); one JSON row a batch ("section": "cache")."""
    from moebus.bench.decode import experts_mib, main

    quarter_mib = experts_mib(model, "bf16") / 4
    tokens = "4" if quant9_sweep.QUICK else os.environ.get("CACHE_TOKENS", "16")
    for dtype in os.environ.get("CACHE_DTYPES", "fp8,int4,bf16").split(","):
        if time.time() > deadline_s:
            quant9_sweep.emit({"section": "cache_skipped", "experts": dtype, "why": "no time left"})
            continue
        began, out = time.perf_counter(), io.StringIO()
        args = ["--model", model, "--device", os.environ.get("DEVICE", "cuda"), "--batch", "1,8", "--tokens", tokens,
                "--repeats", "1", "--no-service", "--json", "--experts-dtype", dtype,
                "--attention-dtype", ATTENTION[dtype], "--cache-mib", str(quarter_mib)]
        try:
            with contextlib.redirect_stdout(out):
                main(args)
        except Exception as e:  # noqa: BLE001 - one dtype that fails leaves the others to run
            quant9_sweep.emit({"section": "failed", "experts": dtype, "attention": ATTENTION[dtype],
                               "setting": "25% MiB", "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        for line in out.getvalue().splitlines():
            row = json.loads(line) if line.startswith("{") else {}
            if "tok_s" in row:
                quant9_sweep.emit({"section": "cache", "experts": dtype, "attention": ATTENTION[dtype],
                                   "run_s": time.perf_counter() - began,
                                   **{k: row.get(k) for k in ("batch", "tok_s", "us_per_layer", "hit_rate",
                                                              "expert_cache_mib", "cache_frac", "layers",
                                                              "h2d_bytes_per_step", "pcie_bound_tok_s")}})


def summary(path: str) -> None:
    quant15_bench.summary(path)
    rows = quant9_sweep.log_rows(path)
    cache = [r for r in rows if r.get("section") == "cache"]
    if not cache:
        return
    base = {r["batch"]: r["tok_s"] for r in cache if r["experts"] == "bf16"}
    against = "bf16 of the same call" if base else "bf16 of the fifteenth session's call B (42.5 / 317.5 tok/s)"
    base = base or BF16_QUARTER
    print(f"== a cache of bf16's 25% MiB (bench decode in process; x {against})")
    for r in cache:
        ratio = r["tok_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
        print(f"{r['experts']}:{r['attention']} b{r['batch']} {r['tok_s']:7.1f} tok/s {ratio:5.2f}x "
              f"hit {r['hit_rate'] or 0:.3f} slots {r['cache_frac'] or 0:.2f} {r['expert_cache_mib'] or 0:.0f} MiB")


def main() -> None:
    if sys.argv[1] == "--summary":
        summary(sys.argv[2])
        return
    import moebus.bench.decode as bench

    original = bench._in_process
    bench._in_process = quant15_bench._with_tokens(original)
    quant9_sweep.main()
    deadline = os.environ.get("CACHE_BY")
    if deadline:
        bench._in_process = original  # no greedy ids in the cache runs
        quarter_cache(sys.argv[1], float(deadline))


if __name__ == "__main__":
    main()
