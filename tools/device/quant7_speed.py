"""Issue 16, seventh session: the quantized expert GEMVs after the instruction cuts (quant_words.py),
and bench decode's ratios at a layer count where a step is GPU-bound. One process, so kernels compile
once; one JSON object a line as each figure comes (partial logs keep what finished).

1. ``kernels``: the expert FFN (gate|up then down) at A3B shapes (D 2048, I 768), 8 experts a token
   of 32, median GPU us of 30 event-timed calls. Unlike quant_speed.py the calls rotate over 4
   disjoint sets of 8 experts, so that a call does not find its weights in the 50 MB L2 (fp8's 8
   experts are 37.8 MB); cases: 1 token, 8 tokens on the same 8 experts (bench decode's batch 8:
   copies of one prompt), 8 tokens on 8 random experts each. fp8 twice: e4m3 by the conversion
   instruction (``hw``) and by bit moves (``bits``).
2. ``decode``: ``moebus bench decode`` (in-process, CUDA graphs) on MODEL for bf16 / fp8 / int4
   experts, a cache of bf16's 25% in MiB first (the issue's 2x target), then every expert resident;
   each dtype's host store is built once (the quantizing load timed) and kept for its second run.

    quant7_speed.py MODEL [kernels] [decode]          (TOKENS, REPEATS, BATCH from the environment)
    quant7_speed.py --table LOG"""
import contextlib
import io
import json
import os
import sys
import time

import numpy as np

DTYPES = ("bf16", "fp8", "int4")
HIDDEN, INTER = (int(n) for n in os.environ.get("SHAPE", "2048,768").split(","))  # smaller: a simulator dry run
EXPERTS, TOP_K, SETS = 32, 8, 4


def emit(row: dict) -> dict:
    print(json.dumps(row), file=sys.__stdout__, flush=True)  # past bench decode's captured stdout
    return row


def _blobs(dtype: str, rng):
    import quant_speed

    quant_speed.HIDDEN, quant_speed.INTER = HIDDEN, INTER
    return quant_speed._arena(dtype, rng)


def _tables(rng, tokens: int, case: str, expert_set: int):
    """pair_token, pair_slot, pair_out (sorted by slot, as the stage sorts pairs) for one call."""
    if case == "random":
        chosen = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]).ravel()
    else:  # every token on the set's 8 experts
        chosen = np.tile(np.arange(expert_set * TOP_K, (expert_set + 1) * TOP_K), tokens)
    order = np.argsort(chosen, kind="stable")
    return [a.astype(np.int32) for a in (order // TOP_K, chosen[order], order)], len(np.unique(chosen))


def _wait_for_tests() -> None:
    """Time nothing while the GPU tests run in another process (WAIT_PID): two contexts time-slice
    the GPU."""
    pid = os.environ.get("WAIT_PID")
    began = time.perf_counter()
    while pid and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.5)
    emit({"section": "wait", "waited_s": time.perf_counter() - began})


def _kernel_cases(rng):
    """(dtype, tokens, case, MB read a call, run) for every case; run rotates the expert sets."""
    from moebus.cuda.kernels import moe_ffn, moe_quant
    from moebus.cuda.kernels.compat import cuda

    stream = cuda.stream()
    for dtype in DTYPES:
        layout, blobs = _blobs(dtype, rng)
        arena = cuda.to_device(blobs)
        for tokens, case in ((1, "same"), (8, "same"), (8, "random")):
            calls = [_tables(rng, tokens, case, s) for s in range(SETS)]
            tables = [[cuda.to_device(t) for t in c[0]] for c in calls]
            x = cuda.to_device(rng.standard_normal((tokens, HIDDEN), dtype=np.float32))
            out = cuda.device_array((tokens * TOP_K, HIDDEN), np.float32)
            scratch = cuda.device_array((tokens * TOP_K, INTER), np.float32)

            def run(x=x, tables=tables, arena=arena, out=out, scratch=scratch, layout=layout, turn=[0]):
                pairs = tables[turn[0] % SETS]
                turn[0] += 1
                if layout is None:
                    moe_ffn.expert_ffn_cuda(x, *pairs, arena, HIDDEN, INTER, out, scratch, stream=stream)
                else:
                    moe_quant.expert_ffn_quant_cuda(x, *pairs, arena, layout, out, scratch, stream=stream)
            mb = np.mean([c[1] for c in calls]) * blobs.shape[1] * blobs.itemsize / 1e6
            for decode in (("hw", "bits") if dtype == "fp8" and tokens == 1 else ("hw",) if dtype == "fp8" else ("-",)):
                yield dtype, decode, tokens, case, mb, run, stream


def kernels() -> list[dict]:
    from moebus.bench.kernels import time_launches
    from moebus.cuda.kernels import moe_quant
    from moebus.cuda.kernels.quant_words import can_convert_e4m3, hardware_e4m3

    cases = list(_kernel_cases(np.random.default_rng(0)))
    for dtype, decode, tokens, case, mb, run, stream in cases:  # compile while the tests run
        moe_quant.hardware_e4m3 = lambda chunk, decode=decode: decode == "hw" and can_convert_e4m3()
        run()
        stream.synchronize()
    _wait_for_tests()
    rows = []
    for dtype, decode, tokens, case, mb, run, stream in cases:
        moe_quant.hardware_e4m3 = lambda chunk, decode=decode: decode == "hw" and can_convert_e4m3()
        us = time_launches(run, 30, 3, stream)[0]
        rows.append(emit({"section": "kernels", "experts_dtype": dtype, "decode": decode, "tokens": tokens,
                          "case": case, "us": us, "mb": mb, "gb_s": mb / us * 1e3 if us else None}))
    moe_quant.hardware_e4m3 = hardware_e4m3
    return rows


def _keep_stores():
    """Each dtype's host store built once for both cache sizes (quantizing at load is the slow part of a
    run); the time it took is emitted."""
    from moebus.workers import experts

    built, make = {}, experts.HostStore

    def host_store(ckpt, layers, **kwargs):
        key = (str(ckpt.dir), tuple(layers), kwargs.get("experts_dtype", "bf16"))
        if key not in built:
            began = time.perf_counter()
            built[key] = make(ckpt, layers, **kwargs)
            emit({"section": "load", "experts_dtype": key[2], "store_s": time.perf_counter() - began,
                  "store_gib": built[key].total_bytes / 2**30})
        return built[key]

    experts.HostStore = host_store


def decode(model: str) -> list[dict]:
    from moebus.bench.decode import experts_mib, main

    _keep_stores()
    _wait_for_tests()
    quarter_mib = experts_mib(model, "bf16") / 4
    args = ["--model", model, "--device", os.environ.get("DEVICE", "cuda"), "--batch", os.environ.get("BATCH", "1,8"), "--tokens",
            os.environ.get("TOKENS", "32"), "--repeats", os.environ.get("REPEATS", "2"), "--no-service", "--json"]
    rows = []
    for cache in (["--cache-mib", f"{quarter_mib:.1f}"], []):
        for dtype in DTYPES:
            began = time.perf_counter()
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                main(args + ["--experts-dtype", dtype] + cache)
            for line in out.getvalue().splitlines():
                row = json.loads(line) if line.startswith("{") else {}
                if "tok_s" in row:  # the per-batch rows (not the service's summary)
                    rows.append(emit({"section": "decode", "cache": "25% of bf16's MiB" if cache else "all resident",
                                      "run_s": time.perf_counter() - began,
                                      **{k: row.get(k) for k in ("experts_dtype", "batch", "tok_s", "ms_per_step",
                                                                 "us_per_layer", "hit_rate", "expert_cache_mib",
                                                                 "cache_frac", "layers", "h2d_gb_s",
                                                                 "h2d_bytes_per_step", "pcie_bound_tok_s")}}))
    return rows


def table(rows: list[dict]) -> None:
    print("\nexperts decode tokens case      us     MB   GB/s  (expert FFN, A3B, 8 of 32 a token, L2 rotated)")
    for r in (r for r in rows if r["section"] == "kernels" and r["us"]):  # the simulator times nothing
        print(f"{r['experts_dtype']:7} {r['decode']:6} {r['tokens']:6} {r['case']:7} {r['us']:6.1f} {r['mb']:6.1f} "
              f"{r['gb_s']:6.0f}")
    for r in (r for r in rows if r["section"] == "wait"):
        print(f"waited {r['waited_s']:.1f} s for the GPU tests")
    for r in (r for r in rows if r["section"] == "load"):
        print(f"host store {r['experts_dtype']}: {r['store_s']:.1f} s ({r['store_gib']:.2f} GiB)")
    decoded = [r for r in rows if r["section"] == "decode"]
    base = {(r["cache"], r["batch"]): r["tok_s"] for r in decoded if r["experts_dtype"] == "bf16"}
    if decoded:
        print(f"\ncache                 experts batch    tok/s  x bf16  us/layer  hit rate  cache MiB  share  PCIe GB/s "
              f"MB/step  PCIe-bound tok/s ({decoded[0]['layers']} layers)")
    for r in decoded:
        ratio = r["tok_s"] / base[(r["cache"], r["batch"])] if (r["cache"], r["batch"]) in base else float("nan")
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        bound = "-" if not r.get("pcie_bound_tok_s") else f"{r['pcie_bound_tok_s']:.1f}"
        print(f"{r['cache']:21} {r['experts_dtype']:7} {r['batch']:5} {r['tok_s']:8.1f} {ratio:6.2f}x "
              f"{r['us_per_layer']:8.1f} {hit:>9} {r['expert_cache_mib']:9.1f} {r['cache_frac']:6.3f} "
              f"{r['h2d_gb_s'] or 0:9.1f} {(r['h2d_bytes_per_step'] or 0) / 1e6:8.1f} {bound:>8}")


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        with open(sys.argv[2]) as log:
            table([json.loads(line) for line in log if line.startswith("{")])
        sys.exit(0)
    model, sections = sys.argv[1], sys.argv[2:] or ["kernels", "decode"]
    for name in sections:
        try:
            {"kernels": kernels, "decode": lambda: decode(model)}[name]()
        except Exception as e:  # noqa: BLE001 - one section's failure leaves the other's figures
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
