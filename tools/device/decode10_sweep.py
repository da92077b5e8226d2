"""decode9_sweep.py with each setting's CUPTI profile at every batch size it runs (decode9_sweep's
profile is batch 1 only), the full profile into OUT_FILE and only its router and attention lines
and busy totals to stdout. Each setting: the decode graphs recaptured, bench decode's own
`_in_process` (greedy after a 32-token prompt, median step of the second of 2 repeats of 64 tokens,
launched ahead, all resident), then PROFILE_STEPS replayed steps one at a time under torch.profiler.
Eleventh session: "carveout": N sets every compiled kernel's preferred shared-memory carveout
(launch.prefer_shared_carveout; -1, the driver's choice, in settings without it) before the graphs
are recaptured; "timeline": "NAME" prints, at every profiled batch, the kernels around the 10th call
of the kernel whose name contains NAME (start, length, idle before, stream): where the graph waits.
Twelfth session: "pdl": "0" / "programmatic" / "launch_order" sets MOEBUS_PDL (kernels/pdl.py) before
the graphs are recaptured, and each row then gives the graphs' edge counts (kernel nodes, waiting, converted).
Usage: decode10_sweep.py MODEL_DIR SETTINGS.json PROFILE_STEPS OUT_FILE"""
import contextlib
import io
import json
import os
import sys
import time

from torch.profiler import ProfilerActivity, profile

from decode7_bench import PROMPT, REPEATS, TOKENS, constant, drop_graphs
from decode8_sweep import kernel_events, print_profile, step_figures
from decode_profile import short_name
from moebus.bench.decode import _in_process
from moebus.cuda.kernels.launch import prefer_shared_carveout
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

KEEP = ("norm_route", "inflight_route", "attention", "merge_splits", "busy span", "grouped_moe", "split_rows",
        "192x16")  # profile lines to stdout
SPECIAL = ("batches", "carveout", "timeline", "pdl")  # not kernel constants


def print_timeline(prof, marker: str, before: int = 12, after: int = 3) -> None:
    """The kernels around the 10th call of ``marker`` in the trace: us from the first shown, length,
    idle since the previous one ended, CUDA stream (main's redirect puts it into OUT_FILE too)."""
    events = sorted((e.time_range.start, e.time_range.end, short_name(e.name), getattr(e, "device_resource_id", "?"))
                    for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0)
    hits = [i for i, e in enumerate(events) if marker in e[2]]
    if len(hits) < 10:
        print(f"   timeline: {len(hits)} calls of {marker}")
        return
    shown = events[max(0, hits[9] - before):hits[9] + after + 1]
    origin, prev_end = shown[0][0], None
    print(f"   timeline around the 10th {marker} (us from the first shown, length, idle before, stream):")
    for start, end, name, stream in shown:
        idle = "" if prev_end is None else f"{start - prev_end:7.2f}"
        print(f"   {start - origin:8.2f} {end - start:7.2f} {idle:>7} {stream!s:>4}  {name[:60]}")
        prev_end = end if prev_end is None else max(prev_end, end)


def profile_batch(model, batch: int, steps: int, timeline: str | None = None) -> dict | None:
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
    if timeline and events:
        print_timeline(prof, timeline)
    return step_figures(events, sum(walls) / len(walls) * 1e6, steps) if events else None


def main() -> None:
    model_dir, settings_file, steps, out_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with open(settings_file) as f:
        settings = json.load(f)
    most = max(b for _, values in settings for b in values.get("batches", [1]))
    model = LocalModel(model_dir, device="cuda", num_slots=most, max_context=len(PROMPT) + TOKENS + 32,
                       kv_dtype="bf16")
    layers = model.ckpt.config.num_layers
    defaults = {key: getattr(*constant(key)) for _, values in settings for key in values if key not in SPECIAL}
    carveouts = any("carveout" in values for _, values in settings)
    rows = []
    with open(out_file, "w") as out:
        for name, values in settings:
            for key, value in {**defaults, **values}.items():
                if key not in SPECIAL:
                    setattr(*constant(key), value)
            if carveouts:
                carveout = values.get("carveout", -1)
                print(f"   carveout {carveout} on {prefer_shared_carveout(carveout)} compiled kernels", flush=True)
            if "pdl" in values:
                os.environ["MOEBUS_PDL"] = str(values["pdl"])
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
            if "pdl" in values:
                edges = [g.pdl for g in model.stages[0].graphs.values() if getattr(g, "pdl", None)]
                print(f"   pdl {values['pdl']}: {len(edges)} graphs, {edges[:2]}", flush=True)
            for batch in values.get("batches", [1]) if steps else []:
                text = io.StringIO()
                with contextlib.redirect_stdout(text):
                    p = profile_batch(model, batch, steps, values.get("timeline"))
                    if p is not None:
                        print_profile(f"{name}, batch {batch}", p)
                out.write(text.getvalue())
                out.flush()
                timeline_row = lambda line: line[:12].strip().replace(".", "").isdigit()  # noqa: E731
                print("\n".join(line for line in text.getvalue().splitlines()
                                if line.startswith(("--", "   timeline")) or timeline_row(line)
                                or any(k in line for k in KEEP)), flush=True)
    print("== decode10_sweep", model_dir, layers, "layers")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
