"""decode9_sweep.py with each setting's CUPTI profile at every batch size it runs (decode9_sweep's
profile is batch 1 only), the full profile into OUT_FILE and only its router and attention lines
and busy totals to stdout. Each setting: the decode graphs recaptured, bench decode's own
`_in_process` (greedy after a 32-token prompt, median step of the second of 2 repeats of 64 tokens,
launched ahead, all resident), then PROFILE_STEPS replayed steps one at a time under torch.profiler.
Usage: decode10_sweep.py MODEL_DIR SETTINGS.json PROFILE_STEPS OUT_FILE"""
import contextlib
import io
import json
import sys
import time

from torch.profiler import ProfilerActivity, profile

from decode7_bench import PROMPT, REPEATS, TOKENS, constant, drop_graphs
from decode8_sweep import kernel_events, print_profile, step_figures
from moebus.bench.decode import _in_process
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

KEEP = ("norm_route", "inflight_route", "attention", "merge_splits", "busy span")  # profile lines to stdout


def profile_batch(model, batch: int, steps: int) -> dict | None:
    """decode8_sweep.profile_steps at ``batch`` sequences: per-kernel us a call over ``steps`` steps."""
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(PROMPT)] * batch, tokens=PROMPT * batch))
    last, pos, walls = [PROMPT[-1]] * batch, len(PROMPT), []

    def step():
        nonlocal last, pos
        start = time.perf_counter()
        out = model.step(StepBatch(slots=range(batch), starts=[pos] * batch, lengths=[1] * batch, tokens=last))
        walls.append(time.perf_counter() - start)
        last, pos = [int(t) for t in out.tokens], pos + 1

    for _ in range(4):
        step()
    walls.clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    events = kernel_events(prof)
    return step_figures(events, sum(walls) / len(walls) * 1e6, steps) if events else None


def main() -> None:
    model_dir, settings_file, steps, out_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with open(settings_file) as f:
        settings = json.load(f)
    most = max(b for _, values in settings for b in values.get("batches", [1]))
    model = LocalModel(model_dir, device="cuda", num_slots=most, max_context=len(PROMPT) + TOKENS + 32,
                       kv_dtype="bf16")
    layers = model.ckpt.config.num_layers
    defaults = {key: getattr(*constant(key)) for _, values in settings for key in values if key != "batches"}
    rows = []
    with open(out_file, "w") as out:
        for name, values in settings:
            for key, value in {**defaults, **values}.items():
                if key != "batches":
                    setattr(*constant(key), value)
            drop_graphs(model)
            started = time.perf_counter()
            try:
                figures = [_in_process(model, PROMPT, TOKENS, batch, REPEATS) for batch in values.get("batches", [1])]
            except Exception as e:  # noqa: BLE001 - one setting that fails leaves the others to run
                print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            rows.append(f"{name:<28} " + "  ".join(
                f"b{r['batch']} {r['tok_s']:7.1f} tok/s {r['ms_per_step']:6.3f} ms" for r in figures))
            print(f"{rows[-1]}   ({time.perf_counter() - started:.0f} s, {values})", flush=True)
            for batch in values.get("batches", [1]) if steps else []:
                p = profile_batch(model, batch, steps)
                if p is None:
                    continue
                text = io.StringIO()
                with contextlib.redirect_stdout(text):
                    print_profile(f"{name}, batch {batch}", p)
                out.write(text.getvalue())
                out.flush()
                print("\n".join(line for line in text.getvalue().splitlines()
                                if line.startswith("--") or any(k in line for k in KEEP)), flush=True)
    print("== decode10_sweep", model_dir, layers, "layers")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
