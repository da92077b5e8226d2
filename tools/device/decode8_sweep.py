"""Decode at batch 1 under several settings of the kernels' constants on one loaded model, each with
bench decode's own timing (decode7_bench.py: greedy after a 32-token prompt, median step of the
second of 2 repeats of 64 tokens, in-process, all resident) and a CUPTI trace of replayed steps:
each kernel's GPU us a call, the idle time between kernel nodes inside the step (gap before each
kernel, by kernel) and the idle stretches > 20 us (the graph launch, the host between steps).
A setting with "probe": true is followed by host_probe; "batches": [1, 8] sets its own batch sizes. Usage: decode8_sweep.py MODEL_DIR BATCHES SETTINGS.json [PROFILE_STEPS]"""
import json
import sys
import time
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from decode7_bench import PROMPT, REPEATS, TOKENS, constant, drop_graphs
from decode_profile import short_name
from moebus.bench.decode import _in_process
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel


def kernel_events(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, short name) of every kernel, in start order."""
    events = [(e.time_range.start, e.time_range.end, short_name(e.name)) for e in prof.events()
              if e.device_type.name == "CUDA" and e.device_time_total > 0]
    return sorted(events)


def profile_steps(model, steps: int) -> dict:
    """Per-kernel us a call, the gaps before each kernel inside a step, host time, over ``steps``
    replayed decode steps at batch 1."""
    model.step(StepBatch(slots=range(1), starts=[0], lengths=[len(PROMPT)], tokens=PROMPT))
    last, pos = [PROMPT[-1]], len(PROMPT)
    walls = []

    def step():
        nonlocal last, pos
        start = time.perf_counter()
        out = model.step(StepBatch(slots=range(1), starts=[pos], lengths=[1], tokens=last))
        walls.append(time.perf_counter() - start)
        last, pos = [int(t) for t in out.tokens], pos + 1

    for _ in range(4):
        step()
    walls.clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    events = kernel_events(prof)
    if not events:  # no CUPTI (the simulator): nothing to report
        return None
    return step_figures(events, sum(walls) / len(walls) * 1e6, steps)


def step_figures(events: list[tuple[float, float, str]], wall_us: float, steps: int) -> dict:
    """The figures of profile_steps from the kernel (and copy) events (start, end, name) in start
    order of ``steps`` steps. Stretches > 50 us without an event (the host between steps, and the
    graph's launch after its input copy) cut the trace into segments: a step's span is its segments'
    total; idle stretches > 20 us are listed with the events around them."""
    busy, gaps, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    span_us, seg_start, prev_end, prev_name, big, since = 0.0, None, None, None, [], 0
    for start, end, name in events:
        since += 1
        if prev_end is not None and start - prev_end > 20.0:  # where the GPU waited: after which event
            big.append((start - prev_end, prev_name, name, since))
            since = 0
        if prev_end is None or start - prev_end > 50.0:
            if seg_start is not None:
                span_us += prev_end - seg_start
            seg_start = start
        else:
            gaps[name] += max(0.0, start - prev_end)
        busy[name] += end - start
        calls[name] += 1
        prev_end, prev_name = max(end, prev_end or end), name
    span_us = (span_us + prev_end - seg_start) / steps
    return {"steps": steps, "span_us": span_us, "busy_us": sum(busy.values()) / steps,
            "gap_us": sum(gaps.values()) / steps, "host_us": wall_us - span_us, "wall_us": wall_us, "big_gaps": big,
            "kernels": {k: (calls[k] / steps, busy[k] / calls[k], gaps[k] / calls[k]) for k in busy}}


def host_probe(model, steps: int = 24) -> None:
    """Where a batch-1 step's time outside the kernels goes: the step's wall time, the captured graph
    replayed alone (launch + synchronize; its launch call alone), and cProfile's top host functions."""
    import cProfile
    import pstats
    import statistics

    model.step(StepBatch(slots=range(1), starts=[0], lengths=[len(PROMPT)], tokens=PROMPT))
    last, pos, walls = [PROMPT[-1]], len(PROMPT), []
    for i in range(steps):
        start = time.perf_counter()
        out = model.step(StepBatch(slots=range(1), starts=[pos], lengths=[1], tokens=last))
        walls.append(time.perf_counter() - start)
        last, pos = [int(t) for t in out.tokens], pos + 1
    stage = model.stages[-1]
    captured = next(g for key, g in stage.graphs.items() if key[0] == 1)
    stream = captured.backend.stream
    launch_s, replay_s = [], []
    for _ in range(steps):
        stream.synchronize()
        start = time.perf_counter()
        captured.graph.launch(captured.stream)
        launched = time.perf_counter()
        stream.synchronize()
        launch_s.append(launched - start)
        replay_s.append(time.perf_counter() - start)
    print(f"-- host probe: step {statistics.median(walls) * 1e6:.0f} us (median of {steps}), graph replayed alone "
          f"{statistics.median(replay_s) * 1e6:.0f} us (launch call {statistics.median(launch_s) * 1e6:.0f} us)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        out = model.step(StepBatch(slots=range(1), starts=[pos], lengths=[1], tokens=last))
        last, pos = [int(t) for t in out.tokens], pos + 1
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:18]  # by own time
    print(f"   {'own us/step':>11} {'cum us/step':>11} {'calls/step':>10}  function")
    for (file, line, func), (_, calls, own, cum, _) in rows:
        print(f"   {own / steps * 1e6:11.1f} {cum / steps * 1e6:11.1f} {calls / steps:10.1f}  "
              f"{file.rsplit('/', 2)[-1]}:{line} {func}")


def print_profile(name: str, p: dict) -> None:
    print(f"-- {name}: {p['steps']} steps, wall {p['wall_us']:.0f} us/step under the profiler, busy span "
          f"{p['span_us']:.0f} (kernels {p['busy_us']:.0f} + gaps {p['gap_us']:.0f}), rest {p['host_us']:.0f} "
          f"(host, graph launch, profiler)")
    for gap, before, after, kernels in p["big_gaps"][:8]:
        print(f"   idle {gap:7.1f} us after {before[-40:]} before {after[-40:]} ({kernels} kernels since the last)")
    print(f"   {'kernel':<40} {'calls':>6} {'us/call':>8} {'gap/call':>8} {'us/step':>8}")
    for k, (calls, us, gap) in sorted(p["kernels"].items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        print(f"   {k[:40]:<40} {calls:6.1f} {us:8.2f} {gap:8.2f} {calls * us:8.1f}")


def main() -> None:
    model_dir, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
    with open(sys.argv[3]) as f:
        settings = json.load(f)
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    most = max([*batches, *(b for _, values in settings for b in values.get("batches", []))])
    model = LocalModel(model_dir, device="cuda", num_slots=most, max_context=len(PROMPT) + TOKENS + 32,
                       kv_dtype="bf16")
    layers = model.ckpt.config.num_layers
    special = ("probe", "batches")  # not constants: host_probe after it; its own batch sizes
    defaults = {key: getattr(*constant(key)) for _, values in settings for key in values if key not in special}
    rows = []
    for name, values in settings:
        for key, value in {**defaults, **values}.items():
            if key not in special:
                setattr(*constant(key), value)
        drop_graphs(model)
        started = time.perf_counter()
        try:
            figures = [_in_process(model, PROMPT, TOKENS, batch, REPEATS) for batch in values.get("batches", batches)]
        except Exception as e:  # noqa: BLE001 - one setting that fails leaves the others to run
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        line = "  ".join(f"b{r['batch']} {r['tok_s']:7.1f} tok/s {r['ms_per_step']:6.3f} ms "
                         f"{r['ms_per_step'] * 1e3 / layers:5.1f} us/layer" for r in figures)
        p = profile_steps(model, steps) if steps else None
        if p:
            line += f"  | busy span {p['span_us']:5.0f} = kernels {p['busy_us']:5.0f} + gaps {p['gap_us']:4.0f}"
        rows.append(f"{name:<30} {line}")
        print(f"{rows[-1]}   ({time.perf_counter() - started:.0f} s, {values})", flush=True)
        if p:
            print_profile(name, p)
        if values.get("probe"):
            host_probe(model)
    print("== decode8_sweep", model_dir, layers, "layers")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
