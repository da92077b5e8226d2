"""The workers' log lines of the measured cold start in `bench vision-cycle -v --cold-starts 2`'s log
(as gap10.sh runs it): the hand-back's VRAM steps summed up (count, min / median / max ms,
experts moved down), then the slow decode steps and the vision worker's start by part, each at its
time in ms after the hand-back's first VRAM step, to place the bench's large gaps.

    python3 tools/device/gap6_logs.py CYCLE_LOG"""
from __future__ import annotations

import re
import statistics
import sys
from datetime import datetime

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) \w+ (.*)$")
VRAM = re.compile(r"gpu\d VRAM ([\d.]+|None): (\d+) expert slots, ([\d.]+) ms .* (\d+) experts moved")
MAX_LINES = 40
WANTED = ("decode step", "vision worker start on", "vision worker ready", "VRAM None")


def lines(path: str):
    for line in open(path, errors="replace"):
        m = STAMP.match(line)
        if m:
            yield datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), m.group(3)


def measured(path: str) -> tuple[list[tuple[float, str]], float | None]:
    """The log's lines and the time of the measured cold start's first VRAM step (the first after
    the first cold start's regrow, its bare VRAM)."""
    rows, regrown, origin = list(lines(path)), False, None
    for t, text in rows:
        if "VRAM None" in text:
            regrown = True
        elif regrown and VRAM.search(text):
            origin = t
            break
    return rows, origin


def main(path: str) -> None:
    rows, origin = measured(path)
    if origin is None:
        print("no hand-back VRAM step found after the first regrow")
        return
    rows = [(t, text) for t, text in rows if t >= origin - 0.2]
    steps = []
    for t, text in rows:
        if "VRAM None" in text and steps:
            break  # the measured cycle's own regrow: its hand-back is over
        if VRAM.search(text):
            steps.append((t, VRAM.search(text)))
    ms = sorted(float(m.group(3)) for _, m in steps)
    print(f"hand-back VRAM steps: {len(ms)}, {ms[0]:.1f} / {statistics.median(ms):.1f} / {ms[-1]:.1f} ms, "
          f"{sum(int(m.group(4)) for _, m in steps)} experts moved down, over {1e3 * (steps[-1][0] - origin):.0f} ms")
    wanted = [(t, text) for t, text in rows if any(w in text for w in WANTED)]
    for t, text in wanted[:MAX_LINES]:
        print(f"  {1e3 * (t - origin):8.0f} ms  {text[:150]}")


if __name__ == "__main__":
    main(sys.argv[1])
