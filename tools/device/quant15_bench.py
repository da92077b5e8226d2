"""Issue 16, fifteenth session (branch quant15): quant9_sweep.py's sweep (per (experts, attention) one load, per
setting of the kernels' constants the decode graphs recaptured, bench decode's tok/s all resident, CUPTI us a
kernel in the graph), plus the greedy ids of each batch-1 setting (16 after the prompt, and their log p) so
that the new kernels' tokens can be compared with the old kernels'; and a short summary of a sweep's log.

    quant15_bench.py MODEL PLAN.json [PROFILE_STEPS]     (quant9_sweep.py's arguments; QUICK=1: a warm-up)
    quant15_bench.py --summary LOG                       (the summary, x bf16 and us a layer by kernel group)"""
import sys

import quant9_sweep

GREEDY_TOKENS = 16


def greedy_ids(model, prompt, count: int) -> tuple[list[int], list[float]]:
    """The greedy ids after ``prompt`` and the log p of each."""
    from moebus.workers.batch import StepBatch

    out = model.step(StepBatch(slots=[0], starts=[0], lengths=[len(prompt)], tokens=prompt))
    ids, logprobs = [int(out.tokens[0])], [float(out.logprobs[0])]
    for i in range(count - 1):
        out = model.step(StepBatch(slots=[0], starts=[len(prompt) + i], lengths=[1], tokens=[ids[-1]]))
        ids.append(int(out.tokens[0]))
        logprobs.append(float(out.logprobs[0]))
    return ids, logprobs


def _with_tokens(original):
    def in_process(model, prompt, tokens, batch, repeats, *args, **kwargs):
        result = original(model, prompt, tokens, batch, repeats, *args, **kwargs)
        if batch == 1 and not quant9_sweep.QUICK:
            ids, logprobs = greedy_ids(model, prompt, GREEDY_TOKENS)
            quant9_sweep.emit({"section": "tokens", "ids": ids, "logprobs": logprobs})
        return result

    return in_process


def group(label: str) -> str | None:
    """experts / projections / None of a kernel label (quant9_sweep.kernel_table's)."""
    if label.startswith(("moe_ffn.", "moe_quant.", "moe_quant_round.", "grouped_moe.", "moe_quant_mma_")):
        return "experts"
    if label.startswith(("linear.", "linear_quant.", "linear_quant_fp8.", "gemm", "linear_quant_mma ")):
        return "proj"
    return None


def summary(path: str) -> None:
    rows = quant9_sweep.log_rows(path)
    ids, reference, base = None, {}, {}  # ids: the last "tokens" row (ids, logprobs)
    print("== quant15 summary (decode all resident; x bf16 of the same call; us a layer; kernels: CUPTI, us a layer)")
    for r in rows:
        if r.get("section") == "tokens":
            ids = (r["ids"], r.get("logprobs") or [0.0] * len(r["ids"]))
            continue
        if r.get("section") == "failed":
            print(f"FAILED {r['experts']}:{r['attention']} {r['setting']}: {r['error'][:160]}")
            continue
        if r.get("section") != "decode":
            continue
        key = (r["experts"], r["attention"])
        if r["experts"] == "bf16" and r["attention"] == "bf16":
            base.setdefault(r["batch"], r["tok_s"])
        ratio = r["tok_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
        layers = r["layers"]
        parts = {}
        for label, (calls, us) in (r.get("kernels") or {}).items():
            g = group(label)
            if g and calls >= layers:  # lm_head (once a step) left out
                parts[g] = parts.get(g, 0.0) + calls * us / layers
        agree = ""
        if r["batch"] == 1 and ids is not None:  # against the first setting of these dtypes: equal ids, and
            reference.setdefault(key, ids)     # the largest |log p| difference while they are equal
            (mine, mine_lp), (ref, ref_lp) = ids, reference[key]
            equal = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), len(mine))
            most = max((abs(a - b) for a, b in zip(mine_lp[:equal], ref_lp[:equal])), default=0.0)
            agree = f" ids {equal}/{len(mine)} dlogp {most:.1e}"
            ids = None
        print(f"{r['experts']}:{r['attention']} {r['setting'][:18]:18} b{r['batch']} {r['tok_s']:7.1f} tok/s {ratio:5.2f}x "
              f"{r['us_per_layer']:6.1f} us/layer; experts {parts.get('experts', 0):5.1f} proj {parts.get('proj', 0):5.1f}"
              + agree)


def main() -> None:
    if sys.argv[1] == "--summary":
        summary(sys.argv[2])
        return
    import moebus.bench.decode as bench

    bench._in_process = _with_tokens(bench._in_process)
    quant9_sweep.main()


if __name__ == "__main__":
    main()
