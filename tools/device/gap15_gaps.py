"""What each of the text streams' largest gaps through a cold image was made of (issue 20, fifteenth
session): reads a ``moebus bench vision-cycle -v`` log (tools/device/gap15.sh) and, for each of the
largest gaps the bench printed ("largest gaps by phase": from - to ms after the image was sent, and
the phase that holds its middle), prints the workers' and broker's log lines stamped within it, in ms
after the image was sent: the steps (``MOEBUS_LOG_STEPS=1``: every step's time and the wait before
it), a slow INFO, a step that came late (the broker's time), a VRAM resize, the vision worker's start, a
long garbage collection (``MOEBUS_LOG_GC_MS``).
A log line is stamped when it is written: a step's line at its end.

    python3 tools/device/gap15_gaps.py cycle.log[.gz] [--count 3] [--margin-ms 6]
"""
from __future__ import annotations

import argparse
import gzip
import re
from datetime import datetime

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) \w+ (.*)$")
SENT = re.compile(r"the image was sent at (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
GAP = re.compile(r"([\d.]+): (-?\d+) - (-?\d+) ([a-z_-]+)")
STEP = re.compile(r"gpu(\d+) step (\d+): (\d+) tokens, ([\d.]+) ms, (-?[\d.]+) ms after the last")
SKIP = ("cuBLAS gemm",)  # the vision worker's first loads: gap12.py lists them


def seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def read(path: str) -> tuple[float | None, list[tuple[float, float, float, str]], list[tuple[float, str, str]]]:
    """(the image's send time, the largest gaps as (ms, from ms, to ms, phase), the stamped lines)."""
    sent, gaps, lines = None, [], []
    with (gzip.open(path, "rt", errors="replace") if path.endswith(".gz") else open(path, errors="replace")) as f:
        for line in f:
            if (m := SENT.search(line)) and not line[:4].isdigit():
                sent = seconds(m.group(1))
            elif line.startswith("  largest gaps by phase"):
                gaps = [(float(g), float(a), float(b), p) for g, a, b, p in GAP.findall(line.split(":", 1)[1])]
            elif (m := STAMP.match(line)) and not any(s in line for s in SKIP):
                lines.append((seconds(m.group(1)), m.group(2), m.group(3).strip()))
    return sent, gaps, lines


def distinct(gaps: list[tuple[float, float, float, str]], count: int) -> list[tuple[float, float, float, str]]:
    """The largest gaps, one of each pair the streams of one batch share (the same end within 2 ms)."""
    out = []
    for gap in gaps:
        if all(abs(gap[2] - g[2]) > 2 for g in out):
            out.append(gap)
    return out[:count]


def steps_line(found: list[tuple[float, str]]) -> str:
    """MOEBUS_LOG_STEPS' lines as 'id tokens: ms (+ms waited)', one line."""
    parts = []
    for _, text in found:
        m = STEP.search(text)
        if m:
            parts.append(f"{m.group(2)} {m.group(3)}t: {float(m.group(4)):.1f} (+{float(m.group(5)):.1f})")
    return "; ".join(parts)


RATIO = re.compile(r"^text streams' largest gap (through hand-back, start and encode|through the whole cold start)"
                   r".* / their median before \(worst stream\): ([\d.]+)")
PHASE_ROW = re.compile(r"^  (handback|start|encode|prefill) +([\d.]+) +\d+ +([\d.-]+) +([\d.-]+) +[\d.-]+ +\d+ +([\d.-]+)"
                       r" +[\d.-]+ +([\d.-]+)")
CHUNK = re.compile(r"a prompt chunk of (\d+) tokens \(slot \d+, from \d+\) done in (\d+) steps")
NOTED = ("INFO took", "after the last one ended", "took", "VRAM", "vision worker start on", "garbage collection")


def short(text: str) -> str:
    """A noted line without its worker's name and its parenthesis (an INFO's keeps its driver part)."""
    text = re.sub(r"^gpu\d+:? ", "", text)
    return text if "INFO took" in text else text.split(" (")[0]


def summary(path: str, tag: str, count: int, margin_ms: float) -> list[str]:
    """A run's few lines for the call's tail (~1,100 characters): the ratios, the phases' lengths, each
    phase's median / largest gap with its step ms and misses a step, the chunks, then the largest gaps
    with their phase and what the workers noted in them, and the steps in the largest one."""
    ratios, split, rows, chunks = {}, "", [], []
    opener = gzip.open(path, "rt", errors="replace") if path.endswith(".gz") else open(path, errors="replace")
    with opener as f:
        for line in f:
            if m := RATIO.match(line):
                ratios["until encoded" if "hand-back" in m.group(1) else "whole"] = m.group(2)
            elif line.startswith("cold image request") and "hand-back requests" in line:
                split = re.sub(r"(\d+)\.\d ms", r"\1", line.split(":", 1)[1].split("(")[0].strip()) + " ms"
            elif m := PHASE_ROW.match(line):
                rows.append(f"{m.group(1)} {m.group(3)}/{m.group(4)} (step {m.group(5)}, miss {m.group(6)})")
            elif m := CHUNK.search(line):
                chunks.append(f"{m.group(1)}t/{m.group(2)}")
    out = [f"{tag}: {ratios.get('until encoded', '-')}x until encoded, {ratios.get('whole', '-')}x whole; {split}",
           "  gap med/max ms: " + "; ".join(rows[-4:]) + "; chunks (tokens/steps): " + ", ".join(chunks[-3:])]
    sent, gaps, lines = read(path)
    for i, (gap_ms, begin, end, phase) in enumerate(distinct(gaps, count) if sent is not None else []):
        inside = [(t, text) for t, _, text in lines if begin - 1 <= 1e3 * (t - sent) <= end + margin_ms]
        noted = [f"{1e3 * (t - sent):.0f} {short(text)}" for t, text in inside
                 if any(k in text for k in NOTED) and not STEP.search(text)]
        out.append(f"  {gap_ms:.1f} {phase} {begin:.0f}-{end:.0f}: " + ("; ".join(noted)[:150] or "no worker line"))
        if i == 0 and (steps := steps_line([(0.0, text) for _, text in inside])):
            out.append(f"    steps (id tokens: ms (+waited)): {steps}"[:180])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--summary", metavar="TAG", help="only a few lines for the call's tail, named TAG")
    p.add_argument("--count", type=int, default=3)
    p.add_argument("--margin-ms", type=float, default=6.0, help="lines stamped this long after the gap count too")
    p.add_argument("--width", type=int, default=170)
    args = p.parse_args(argv)
    if args.summary:
        print("\n".join(summary(args.log, args.summary, args.count, args.margin_ms)))
        return 0
    sent, gaps, lines = read(args.log)
    if sent is None or not gaps:
        print(f"{args.log}: no 'the image was sent at' or 'largest gaps by phase' line (an older bench?)")
        return 1
    for gap_ms, begin, end, phase in distinct(gaps, args.count):
        found = [(1e3 * (t - sent), f"{who.split('.')[-1].split('[')[0]}: {text}") for t, who, text in lines
                 if begin - 1 <= 1e3 * (t - sent) <= end + args.margin_ms]
        print(f"gap {gap_ms:.1f} ms, {begin:.0f} - {end:.0f} ms after the image was sent, in {phase}:")
        steps = steps_line(found)
        if steps:
            print(f"    steps (id tokens: ms (+ms waited before it)): {steps}"[: args.width * 2])
        for at, text in found:
            if not STEP.search(text):
                print(f"    {at:7.1f}  {text}"[: args.width])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
