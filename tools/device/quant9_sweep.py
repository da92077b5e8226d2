"""Issue 16, ninth session (branch quant9): where a quantized decode step's time goes and which work
shapes of the quantized GEMVs (moe_quant.py, linear_quant.py) shorten it. For each (experts,
attention) dtype pair one model load (each experts dtype's host store built once, quant7_speed's
_keep_stores), then for each setting of the kernels' constants (decode7_bench.constant: "module.NAME")
the decode graphs recaptured, bench decode's own timing (_in_process: greedy after a 32-token prompt,
median step of the second of REPEATS repeats of TOKENS tokens, all resident) at batch 1 and 8, and a
CUPTI trace of PROFILE_STEPS replayed steps at each batch: every kernel's us a call in the graph. A
kernel launched k times a layer under one name (gate|up and down are both moe_quant.quant_rows; qkv
and o both linear_quant.fp8_rows where their shapes agree) is split by its place in the layer: #0, #1.
One JSON object a line as figures come (a cut-off run keeps what finished), then a table.

    quant9_sweep.py MODEL PLAN.json [PROFILE_STEPS]     PLAN: [[experts, attention, [[name, {constants}], ...]], ...]
    (a setting may name its batches: [name, {constants}, [1]]; default 1 and 8)
    QUICK=1: 4 tokens, 1 repeat, no trace (compiles every variant into the kernel disk cache: a warm-up)"""
import gc
import json
import os
import sys
import time
from collections import defaultdict

from decode7_bench import PROMPT, constant, drop_graphs
from decode_profile import short_name

QUICK = os.environ.get("QUICK") == "1"
TOKENS = 4 if QUICK else int(os.environ.get("TOKENS", "32"))
REPEATS = 1 if QUICK else int(os.environ.get("REPEATS", "2"))
BATCHES = (1, 8)


def emit(row: dict) -> dict:
    print(json.dumps(row), flush=True)
    return row


def kernel_name(name: str) -> str:
    """module.function of a numba kernel's name as the trace gives it, demangled
    ("moebus::cuda::kernels::moe_quant::_rows_kernel::_3clocals_3e::quant_rows[abi:...](...)") or
    mangled; other kernels' (cuBLAS, copies) names cut to 60 characters."""
    if name.startswith("moebus::"):
        parts = [p.split("[")[0].split("(")[0] for p in name.split("::")[3:]]
        parts = [p for p in parts if p and not p.startswith("_3c")]
        return f"{parts[0]}.{parts[-1]}" if len(parts) > 1 else parts[0] if parts else name[:60]
    return short_name(name)


def kernel_table(prof, steps: int, layers: int) -> dict:
    """{label: (calls a step, us a call)} of the CUDA kernels in a trace of ``steps`` steps."""
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type.name == "CUDA" and e.device_time_total > 0)
    counts = defaultdict(int)
    for _, _, name in events:
        counts[name] += 1
    seen, busy, calls = defaultdict(int), defaultdict(float), defaultdict(int)
    variants = defaultdict(dict)
    for start, end, name in events:
        per_step = counts[name] // steps
        per_layer = per_step // layers if per_step % layers == 0 and per_step >= 2 * layers else 1
        short = kernel_name(name)
        number = variants[short].setdefault(name, len(variants[short]))
        label = f"{short} v{number}" + (f" #{seen[name] % per_layer}" if per_layer > 1 else "")
        seen[name] += 1
        busy[label] += end - start
        calls[label] += 1
    return {k: (calls[k] / steps, busy[k] / calls[k]) for k in busy}


def profile_batch(model, batch: int, steps: int, layers: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from moebus.workers.batch import StepBatch

    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(PROMPT)] * batch,
                         tokens=PROMPT * batch))
    last, pos = [PROMPT[-1]] * batch, len(PROMPT)

    def step():
        nonlocal last, pos
        out = model.step(StepBatch(slots=range(batch), starts=[pos] * batch, lengths=[1] * batch, tokens=last))
        last, pos = [int(t) for t in out.tokens], pos + 1

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    return kernel_table(prof, steps, layers)


def run_config(model_dir: str, experts: str, attention: str, settings: list, steps: int) -> None:
    from moebus.bench.decode import _in_process
    from moebus.cuda.kernels.compat import disk_cache_counts
    from moebus.workers.local import LocalModel

    began = time.perf_counter()
    model = LocalModel(model_dir, device=os.environ.get("DEVICE", "cuda"), num_slots=max(BATCHES), max_context=len(PROMPT) + 64 + 16,
                       kv_dtype="bf16", experts_dtype=experts, attention_dtype=attention,
                       lm_head_dtype=os.environ.get("LM_HEAD_DTYPE", "bf16"))  # lead20.sh's second sweep: fp8
    layers = model.ckpt.config.num_layers
    emit({"section": "load", "experts": experts, "attention": attention, "load_s": time.perf_counter() - began})
    defaults = {key: getattr(*constant(key)) for _, values, *_ in settings for key in values}
    for name, values, *batches in settings:
        for key, value in {**defaults, **values}.items():
            setattr(*constant(key), value)
        drop_graphs(model)
        began = time.perf_counter()
        try:
            for batch in (batches[0] if batches else BATCHES):
                r = _in_process(model, PROMPT, TOKENS, batch, REPEATS)
                row = {"section": "decode", "experts": experts, "attention": attention, "setting": name, "batch": batch,
                       "tok_s": r["tok_s"], "ms_per_step": r["ms_per_step"],
                       "us_per_layer": r["ms_per_step"] * 1e3 / layers, "layers": layers}
                if steps and not QUICK:
                    row["kernels"] = profile_batch(model, batch, steps, layers)
                emit(row)
        except Exception as e:  # noqa: BLE001 - one setting that fails leaves the others to run
            emit({"section": "failed", "experts": experts, "attention": attention, "setting": name,
                  "error": f"{type(e).__name__}: {e}"[:300]})
        loaded, compiled = disk_cache_counts()
        emit({"section": "setting", "setting": name, "s": time.perf_counter() - began, "kernels_loaded": loaded,
              "kernels_compiled": compiled})
    for key, value in defaults.items():
        setattr(*constant(key), value)
    drop_graphs(model)
    del model
    gc.collect()


def table(rows: list[dict]) -> None:
    decoded = [r for r in rows if r["section"] == "decode"]
    base = {r["batch"]: r["tok_s"] for r in decoded if r["experts"] == "bf16" and r["attention"] == "bf16"}
    print(f"{'experts':7} {'attn':5} {'setting':22} batch    tok/s  x bf16 us/layer")
    for r in decoded:
        ratio = r["tok_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
        print(f"{r['experts']:7} {r['attention']:5} {r['setting'][:22]:22} {r['batch']:5} {r['tok_s']:8.1f} {ratio:6.2f}x "
              f"{r['us_per_layer']:8.1f}")
    for r in decoded:
        if not r.get("kernels"):
            continue
        k = r["kernels"]
        per_layer = sum(c * us for c, us in k.values()) / r["layers"]
        print(f"-- {r['experts']}:{r['attention']} {r['setting']} batch {r['batch']}: kernels {per_layer:.1f} us a layer")
        for label, (calls, us) in sorted(k.items(), key=lambda kv: -kv[1][0] * kv[1][1])[:int(os.environ.get("TOP", "14"))]:
            print(f"   {label[:46]:46} {calls:6.1f}/step {us:8.2f} us {calls * us / r['layers']:7.2f} us/layer")


def log_rows(path: str) -> list[dict]:
    """The JSON rows of a sweep's log (emit's lines); a line cut by the call's time limit, or not JSON, is skipped."""
    rows = []
    with open(path) as log:
        for line in log:
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return [r for r in rows if isinstance(r, dict)]


def main() -> None:
    if sys.argv[1] == "--table":
        rows = log_rows(sys.argv[2])
        table(rows)
        return
    from quant7_speed import _keep_stores
    from quant8_speed import _keep_attention

    model_dir = sys.argv[1]
    with open(sys.argv[2]) as f:
        plan = json.load(f)
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    only = os.environ.get("ONLY")  # "experts:attention,...": this process's part of the plan (warm-ups)
    _keep_stores()
    _keep_attention()  # each layer's FP8 q/k/v/o quantized once for every load
    for experts, attention, settings in plan:
        if only and f"{experts}:{attention}" not in only.split(","):
            continue
        run_config(model_dir, experts, attention, settings, steps)


if __name__ == "__main__":
    main()
