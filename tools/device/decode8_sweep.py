"""The decode sweeps' CUPTI helpers (decode10_sweep.py imports them; the eighth session's own sweep
over settings, its host probe and decode8_*.sh were removed in the eleventh: see README.md): a
trace's kernel events, a step's figures from them (each kernel's GPU us a call, the idle time
between kernel nodes inside the step, the idle stretches > 20 us: the graph launch, the host between
steps), and their printout."""
from collections import defaultdict

from decode_profile import short_name


def kernel_events(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, short name) of every kernel, in start order."""
    events = [(e.time_range.start, e.time_range.end, short_name(e.name)) for e in prof.events()
              if e.device_type.name == "CUDA" and e.device_time_total > 0]
    return sorted(events)


def step_figures(events: list[tuple[float, float, str]], wall_us: float, steps: int) -> dict:
    """The figures of ``steps`` profiled decode steps from their kernel (and copy) events (start, end,
    name) in start order, ``wall_us`` a step's wall time. Stretches > 50 us without an event (the
    host between steps, and the graph's launch after its input copy) cut the trace into segments: a
    step's span is its segments' total; idle stretches > 20 us are listed with the events around them."""
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


def print_profile(name: str, p: dict) -> None:
    print(f"-- {name}: {p['steps']} steps, wall {p['wall_us']:.0f} us/step under the profiler, busy span "
          f"{p['span_us']:.0f} (kernels {p['busy_us']:.0f} + gaps {p['gap_us']:.0f}), rest {p['host_us']:.0f} "
          f"(host, graph launch, profiler)")
    for gap, before, after, kernels in p["big_gaps"][:8]:
        print(f"   idle {gap:7.1f} us after {before[-40:]} before {after[-40:]} ({kernels} kernels since the last)")
    print(f"   {'kernel':<40} {'calls':>6} {'us/call':>8} {'gap/call':>8} {'us/step':>8}")
    for k, (calls, us, gap) in sorted(p["kernels"].items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        print(f"   {k[:40]:<40} {calls:6.1f} {us:8.2f} {gap:8.2f} {calls * us:8.1f}")
