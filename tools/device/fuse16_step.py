"""Issues 15 and 16, sixteenth session (branch fuse16): what the decode layer's small kernels (norm_route,
combine_add_rmsnorm, qkv_rope_store) and the launch gaps cost in a batch-1 step, with PDL on and off, and
the step with each candidate switch on. One model load; per setting (environment variables and kernel
constants, "module.NAME" as decode7_bench.constant) the decode graphs recaptured, bench decode's own b1
timing (_in_process, all resident, launched ahead), a CUPTI trace of PROFILE_STEPS replayed steps
(quant9_sweep.profile_batch: us a kernel call; here also the step's busy time, kernel count and the gaps
between kernels) and the greedy ids of 16 steps with their log p (quant15_bench.greedy_ids), compared with
the first setting's: "bits" when every id and log p is equal. A setting's "twice": these kernels launched twice
in a row (the second a copy of the first: same inputs, same outputs), so the step's time with and without
shows what one more launch of each costs the step, waits and gaps included (a span under PDL cannot).

    fuse16_step.py MODEL SETTINGS.json [PROFILE_STEPS]   SETTINGS: [[name, {"env": {..}, "module.NAME": v,
                                                          "twice": ["norm_route"|"combine"|"qkv_rope"]}], ...]
    fuse16_step.py --summary LOG                          (the summary: us a layer by kernel, gaps, x defaults)
    QUICK=1: 4 tokens, 1 repeat, no trace (compiles every variant into the kernel disk cache: a warm-up)"""
import importlib
import json
import os
import sys
import time

import quant9_sweep
from decode7_bench import PROMPT, constant, drop_graphs
from quant15_bench import GREEDY_TOKENS, greedy_ids

SMALL = {"norm_route": "norm_route", "fused.combine": "combine", "fused.qkv": "qkv", "qkv_gemv": "qkv_gemv",
         "fused.add_rmsnorm": "add_rmsnorm"}  # a kernel label's part -> its group
TWICE = {"norm_route": ("moebus.cuda.backends.cuda", "norm_route_cuda"),  # where the backend looks them up
         "combine": ("moebus.cuda.kernels.fused", "combine_add_rmsnorm_cuda"),
         "qkv_rope": ("moebus.cuda.kernels.fused", "qkv_rope_store_cuda")}
TOP = int(os.environ.get("TOP", "12"))
_trace: dict = {}


def _gaps(prof, steps: int) -> dict:
    """Busy us (union of kernel spans), kernels and gaps (us between one kernel's end and the next's start,
    where positive) a step."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.device_time_total > 0)
    busy, gaps, end = 0.0, [], None
    for start, stop in spans:
        if end is not None and start > end:
            gaps.append(start - end)
        if end is None or stop > end:
            busy += stop - (start if end is None else max(start, end))
            end = stop
    inner = sorted(gaps)[:-(steps - 1)] if steps > 1 else gaps  # the host's pauses between steps left out
    return {"kernels_a_step": len(spans) / steps, "busy_us": busy / steps, "gap_us": sum(inner) / steps,
            "gaps_a_step": len(inner) / steps}


def _with_gaps(original):
    def table(prof, steps, layers):
        _trace.update(_gaps(prof, steps))
        return original(prof, steps, layers)
    return table


def _twice(launch):
    def twice(*args, **kwargs):
        launch(*args, **kwargs)
        return launch(*args, **kwargs)
    return twice


def apply(values: dict) -> dict:
    """Set a setting's environment, constants and kernels launched twice; returns what to restore."""
    old = {}
    for key, value in values.items():
        if key == "twice":  # the same launch again (each of these writes fresh outputs from unchanged inputs)
            for name in value:
                module, attr = TWICE[name]
                module = importlib.import_module(module)
                old.setdefault("twice", []).append((module, attr, getattr(module, attr)))
                setattr(module, attr, _twice(getattr(module, attr)))
        elif key == "env":
            for name, v in value.items():
                old.setdefault("env", {})[name] = os.environ.get(name)
                os.environ[name] = str(v)
        else:
            old[key] = getattr(*constant(key))
            setattr(*constant(key), value)
    return old


def restore(old: dict) -> None:
    for key, value in old.items():
        if key == "twice":
            for module, attr, launch in value:
                setattr(module, attr, launch)
        elif key == "env":
            for name, v in value.items():
                os.environ.pop(name, None) if v is None else os.environ.__setitem__(name, v)
        else:
            setattr(*constant(key), value)


def run(model_dir: str, settings: list, steps: int) -> None:
    import moebus.bench.decode as bench
    from moebus.workers.local import LocalModel

    began = time.perf_counter()
    model = LocalModel(model_dir, device=os.environ.get("DEVICE", "cuda"), num_slots=1,
                       max_context=len(PROMPT) + 64 + 2 * GREEDY_TOKENS, kv_dtype="bf16", experts_dtype="bf16",
                       attention_dtype="bf16")
    layers = model.ckpt.config.num_layers
    quant9_sweep.emit({"section": "load", "layers": layers, "load_s": time.perf_counter() - began})
    for name, values in settings:
        old = apply(values)
        drop_graphs(model)
        began = time.perf_counter()
        try:
            r = bench._in_process(model, PROMPT, quant9_sweep.TOKENS, 1, quant9_sweep.REPEATS)
            row = {"section": "decode", "setting": name, "tok_s": r["tok_s"],
                   "us_per_layer": r["ms_per_step"] * 1e3 / layers, "layers": layers}
            if steps and not quant9_sweep.QUICK:  # PROFILE_STEPS 0: no trace (a host without CUPTI)
                row["kernels"] = quant9_sweep.profile_batch(model, 1, steps, layers)
                row.update(_trace)
            if not quant9_sweep.QUICK:
                row["ids"], row["logprobs"] = greedy_ids(model, PROMPT, GREEDY_TOKENS)
            row["s"] = time.perf_counter() - began
            quant9_sweep.emit(row)
        except Exception as e:  # noqa: BLE001 - one setting that fails leaves the others to run
            quant9_sweep.emit({"section": "failed", "setting": name, "error": f"{type(e).__name__}: {e}"[:300]})
        restore(old)
    drop_graphs(model)


def kernel_group(label: str) -> str:
    return next((group for part, group in SMALL.items() if part in label), "other")


def summary(path: str) -> None:
    rows = quant9_sweep.log_rows(path)
    decoded = [r for r in rows if r.get("section") == "decode"]
    for r in rows:
        if r.get("section") == "failed":
            print(f"FAILED {r['setting']}: {r['error'][:200]}")
    if not decoded:
        print("no decode rows")
        return
    base = decoded[0]
    off = next((r for r in decoded if r["setting"] == "pdl_off" and r.get("kernels")), None)
    if off and base.get("kernels"):  # PDL off: each span is the kernel's own time, no wait inside it
        print(f"-- us a layer by kernel: {base['setting']} (PDL spans) / pdl_off (true durations)")
        on, layers = base["kernels"], base["layers"]
        for label, (calls, us) in sorted(off["kernels"].items(), key=lambda kv: -kv[1][0] * kv[1][1])[:TOP]:
            mine = on.get(label, (0, 0.0))
            print(f"   {label[:44]:44} {mine[0] * mine[1] / layers:6.2f} / {calls * us / layers:6.2f}")
    print("== fuse16 summary: b1 all resident; us a layer (wall); CUPTI us a layer: norm_route / combine / qkv_rope / "
          "qkv_gemv; "
          "busy, gaps a step; tokens vs the first setting")
    for r in decoded:
        k, layers = r.get("kernels") or {}, r["layers"]
        part = {}
        for label, (calls, us) in k.items():
            g = kernel_group(label)
            part[g] = part.get(g, 0.0) + calls * us / layers
        agree = ""
        if r.get("ids") and base.get("ids"):
            equal = next((i for i, (a, b) in enumerate(zip(r["ids"], base["ids"])) if a != b), len(r["ids"]))
            most = max((abs(a - b) for a, b in zip(r["logprobs"][:equal], base["logprobs"][:equal])), default=0.0)
            agree = " bits" if equal == len(r["ids"]) and most == 0.0 else f" ids {equal}/{len(r['ids'])} dlogp {most:.1e}"
        print(f"{r['setting'][:16]:16} {r['tok_s']:6.1f} tok/s {r['tok_s'] / base['tok_s']:5.3f}x {r['us_per_layer']:5.1f} us/l;"
              f" nr {part.get('norm_route', 0):4.1f} cb {part.get('combine', 0):4.1f} qkv {part.get('qkv', 0):4.1f}"
              f" qg {part.get('qkv_gemv', 0):4.1f}"
              f"; busy {r.get('busy_us', 0) / 1e3:5.2f} ms"
              f" gaps {r.get('gap_us', 0) / 1e3:5.2f} ms/{r.get('gaps_a_step', 0):4.0f} k {r.get('kernels_a_step', 0):4.0f}"
              + agree)
    stems: dict = {}  # a setting run more than once ("qkv_gemv", "qkv_gemv_2", ...): its mean and range
    for r in decoded:
        stem, _, last = r["setting"].rpartition("_")
        stems.setdefault(stem if last.isdigit() else r["setting"], []).append(r["tok_s"])
    print("   repeated: " + "; ".join(f"{k} {sum(v) / len(v):.1f} ({min(v):.1f}-{max(v):.1f}) x{len(v)}"
                                     for k, v in stems.items() if len(v) > 1))


def main() -> None:
    if sys.argv[1] == "--summary":
        summary(sys.argv[2])
        return
    with open(sys.argv[2]) as f:
        settings = json.load(f)
    only = os.environ.get("ONLY")  # "name,name": this process's part of the settings
    if only:
        settings = [s for s in settings if s[0] in only.split(",")]
    quant9_sweep.kernel_table = _with_gaps(quant9_sweep.kernel_table)
    run(sys.argv[1], settings, int(sys.argv[3]) if len(sys.argv) > 3 else 4)


if __name__ == "__main__":
    main()
