"""A spanning chunk's steps from the worker's CUPTI trace (MOEBUS_TRACE_CHUNK_STEPS, workers/step_trace.py;
tools/device/gap11.sh): per traced step (the first few, then by kind) its wall time, the GPU's busy
time (kernels, and how many ran; host-to-device copies and their MiB; the two overlapping), its idle
time (a step launched eagerly from Python shows as idle time between its kernels); then, over the
chunk's steps, each part of the step (workers/step_parts.py) with the host's time in it and what the
GPU did meanwhile; the CUPTI overhead events within chunk steps (a "Lazy Function Loading" is a kernel's
first use: ~4.5 ms of host time each for cuBLAS's at 17:25); then the kernels and copies that took
the most GPU time in chunk steps and in decode steps.

    python3 tools/device/gap11_trace.py chunk_trace_gpu0.json"""
from __future__ import annotations

import bisect
import json
import statistics
import sys
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
MIB = 1 << 20
MAX_STEP_LINES = 24


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class Timeline:
    """GPU activities sorted by start, so that a window's are found by bisection: the parts' table
    asks for ~2,000 windows among ~50,000 activities (a scan of all per window took minutes, and
    gap11.sh's `timeout 30` cut the table off before its first row at 17:25)."""

    def __init__(self, events):
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]
        self.longest = max((e["dur"] for e in self.events), default=0.0)

    def __iter__(self):
        return iter(self.events)

    def within(self, lo: float, hi: float):
        first = bisect.bisect_left(self.starts, lo - self.longest)
        return self.events[first:bisect.bisect_left(self.starts, hi)]


def clipped(events, lo: float, hi: float):
    if isinstance(events, Timeline):
        events = events.within(lo, hi)
    for e in events:
        a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if b > a:
            yield e, a, b


def gpu_in(gpu, lo: float, hi: float) -> dict:
    """What the GPU did in [lo, hi) (us): busy, kernels, host-to-device copies (time, MiB), idle."""
    spans, kernels, h2d, others, h2d_bytes = [], [], [], [], 0.0
    for e, a, b in clipped(gpu, lo, hi):
        spans.append((a, b))
        if e["cat"] == "kernel":
            kernels.append((a, b))
        elif "HtoD" in e["name"]:
            h2d.append((a, b))
            h2d_bytes += e.get("args", {}).get("bytes", 0) * (b - a) / max(e["dur"], 1e-9)
        else:
            others.append((a, b))
    busy = union(spans)
    return dict(busy=busy, kernels=union(kernels), h2d=union(h2d), h2d_mib=h2d_bytes / MIB, other=union(others),
                idle=(hi - lo) - busy, launches=len(kernels))


def main(path: str) -> None:
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    annotations = [e for e in events if e.get("cat") == "user_annotation"]
    steps = sorted((e for e in annotations if e["name"].startswith("step ")), key=lambda e: e["ts"])
    parts = [e for e in annotations if not e["name"].startswith("step ")]
    gpu = Timeline(e for e in events if e.get("cat") in GPU_CATS)
    kernels = sum(e["cat"] == "kernel" for e in gpu)
    print(f"-- {len(steps)} steps traced, {len(gpu.events)} GPU activities ({kernels} kernels); "
          f"the first {MAX_STEP_LINES}, then by kind")
    print("step (id kind tokens)     wall ms | GPU busy | kernels (count) | HtoD ms (MiB) | other | idle   (ms)")
    chunk_steps, rows = [], defaultdict(list)
    last_chunk_end = max((s["ts"] + s["dur"] for s in steps if " chunk " in s["name"]), default=0)
    for n, s in enumerate(steps):
        lo, hi = s["ts"], s["ts"] + s["dur"]
        g = gpu_in(gpu, lo, hi)
        if n < MAX_STEP_LINES:
            print(f"{s['name']:<26} {s['dur'] / 1e3:6.1f} | {g['busy'] / 1e3:7.1f} | {g['kernels'] / 1e3:7.1f} "
                  f"({g['launches']:4d}) | "
                  f"{g['h2d'] / 1e3:5.1f} ({g['h2d_mib']:6.1f}) | {g['other'] / 1e3:5.1f} | {g['idle'] / 1e3:5.1f}")
        kind = s["name"].split()[2]
        if kind == "chunk":
            chunk_steps.append((lo, hi))
        elif kind == "decode":
            kind = "decode, chunk held" if hi <= last_chunk_end else "decode, after"
        rows[kind].append((s["dur"], g))
    print("kind (steps)                    wall min / median / max | GPU busy | kernels | HtoD (MiB) | idle  (ms, median)")
    for kind, got in rows.items():
        walls = sorted(d for d, _ in got)
        med = lambda key: statistics.median(g[key] for _, g in got) / 1e3  # noqa: E731
        print(f"{kind + f' ({len(got)})':<30} {walls[0] / 1e3:6.1f} / {statistics.median(walls) / 1e3:6.1f} / "
              f"{walls[-1] / 1e3:6.1f} | {med('busy'):6.1f} | {med('kernels'):6.1f} | {med('h2d'):5.1f} "
              f"({statistics.median(g['h2d_mib'] for _, g in got):6.1f}) | {med('idle'):5.1f}")
    if not chunk_steps:
        return
    print(f"-- the {len(chunk_steps)} chunk steps by part (ms a step: host time in the part; the GPU meanwhile)")
    print("part                      host | GPU busy | kernels | HtoD (MiB) | idle")
    by_part = defaultdict(lambda: defaultdict(float))
    for p in parts:
        if not any(lo <= p["ts"] < hi for lo, hi in chunk_steps):
            continue
        g = gpu_in(gpu, p["ts"], p["ts"] + p["dur"])
        row = by_part[p["name"]]
        row["host"] += p["dur"]
        for k, v in g.items():
            row[k] += v
    n = len(chunk_steps)
    for name, row in sorted(by_part.items(), key=lambda kv: -kv[1]["host"]):
        print(f"{name:<24} {row['host'] / n / 1e3:6.2f} | {row['busy'] / n / 1e3:7.2f} | {row['kernels'] / n / 1e3:7.2f} | "
              f"{row['h2d'] / n / 1e3:5.2f} ({row['h2d_mib'] / n:6.1f}) | {row['idle'] / n / 1e3:5.2f}")
    overheads = defaultdict(int)  # CUPTI's own: "Lazy Function Loading" is a kernel's first use (a cuBLAS variant)
    for e in events:
        if e.get("cat") == "overhead" and any(lo <= e["ts"] < hi for lo, hi in chunk_steps):
            overheads[e["name"]] += 1
    if overheads:
        print("-- in the chunk steps, CUPTI overhead events: " + ", ".join(f"{k} {v}" for k, v in overheads.items()))
    for label, wanted in (("chunk", " chunk "), ("decode", " decode ")):
        windows = [(s["ts"], s["ts"] + s["dur"]) for s in steps if wanted in s["name"]]
        if not windows:
            continue
        totals, counts = defaultdict(float), defaultdict(int)
        for lo, hi in windows:
            for e, a, b in clipped(gpu, lo, hi):
                name = e["name"] if e["cat"] == "kernel" else f"[{e['name']}]"
                totals[name[:70]] += b - a
                counts[name[:70]] += 1
        print(f"-- GPU time in the {len(windows)} {label} steps by kernel or copy (ms a step, count a step)")
        for name, total in sorted(totals.items(), key=lambda kv: -kv[1])[:12]:
            print(f"{total / len(windows) / 1e3:7.2f} {counts[name] / len(windows):6.1f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
