"""decode8_sweep.py with launch-ahead: each setting's figures from bench decode's own `_in_process`
(LocalModel.decode: each step launched before the one before is read, unless the setting says
"ahead": false), the CUPTI per-kernel profile of replayed steps one at a time (decode8_sweep's), and
with "ahead_profile": true a CUPTI trace of steps launched ahead: the GPU's idle time between them.
Usage: decode9_sweep.py MODEL_DIR BATCHES SETTINGS.json [PROFILE_STEPS]"""
import json
import sys
import time

from torch.profiler import ProfilerActivity, profile

from decode7_bench import PROMPT, REPEATS, TOKENS, constant, drop_graphs
from decode8_sweep import host_probe, kernel_events, print_profile, profile_steps, step_figures
from moebus.bench.decode import _in_process
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

SPECIAL = ("probe", "batches", "ahead", "ahead_profile")  # not kernel constants


def profile_ahead(model, batch: int, steps: int) -> dict | None:
    """CUPTI over ``steps`` decode steps launched ahead (after 4 unprofiled ones): busy, gaps, and
    the idle stretches between steps (launch-ahead should leave none longer than the copies)."""
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(PROMPT)] * batch, tokens=PROMPT * batch))
    batches = [StepBatch(slots=range(batch), starts=[len(PROMPT) + i] * batch, lengths=[1] * batch,
                         tokens=[PROMPT[-1]] * batch) for i in range(steps + 4)]
    outs = model.decode(batches)
    for _ in range(4):
        next(outs)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for out in outs:
            out.tokens.tolist()
    wall_us = (time.perf_counter() - start) * 1e6 / steps
    events = kernel_events(prof)
    return step_figures(events, wall_us, steps) if events else None


def main() -> None:
    model_dir, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
    with open(sys.argv[3]) as f:
        settings = json.load(f)
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    most = max([*batches, *(b for _, values in settings for b in values.get("batches", []))])
    model = LocalModel(model_dir, device="cuda", num_slots=most, max_context=len(PROMPT) + TOKENS + 32,
                       kv_dtype="bf16")
    layers = model.ckpt.config.num_layers
    defaults = {key: getattr(*constant(key)) for _, values in settings for key in values if key not in SPECIAL}
    rows = []
    for name, values in settings:
        for key, value in {**defaults, **values}.items():
            if key not in SPECIAL:
                setattr(*constant(key), value)
        drop_graphs(model)
        started = time.perf_counter()
        ahead = values.get("ahead", True)
        try:
            figures = [_in_process(model, PROMPT, TOKENS, batch, REPEATS, ahead)
                       for batch in values.get("batches", batches)]
        except Exception as e:  # noqa: BLE001 - one setting that fails leaves the others to run
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        line = "  ".join(f"b{r['batch']} {r['tok_s']:7.1f} tok/s {r['ms_per_step']:6.3f} ms "
                         f"{r['ms_per_step'] * 1e3 / layers:5.1f} us/layer" for r in figures)
        p = profile_steps(model, steps) if steps else None
        if p:
            line += f"  | busy span {p['span_us']:5.0f} = kernels {p['busy_us']:5.0f} + gaps {p['gap_us']:4.0f}"
        rows.append(f"{name:<34} {line}")
        print(f"{rows[-1]}   ({time.perf_counter() - started:.0f} s, {values})", flush=True)
        if p:
            print_profile(name, p)
        if values.get("ahead_profile") and steps:
            for batch in values.get("batches", batches):
                a = profile_ahead(model, batch, steps)
                if a:
                    print_profile(f"{name}, batch {batch} launched ahead", a)
        if values.get("probe"):
            host_probe(model)
    print("== decode9_sweep", model_dir, layers, "layers")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
