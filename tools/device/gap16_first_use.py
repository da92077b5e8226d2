"""What a GPU worker's slow steps were made of (issue 20, sixteenth session: a fresh worker's first prompt
steps took 2.4-7.5 s in the fifteenth session's calls): reads a ``moebus bench vision-cycle -v`` log run
with ``MOEBUS_LOG_STEPS=1 MOEBUS_STEP_STACKS_S=S`` (tools/device/gap16.sh) and prints
- the workers' start lines with their kernel counts (and the names of the kernels they compiled),
- each step over ``--slow-ms`` (its tokens and time), the kernels loaded / compiled in it, and the
  innermost frames its stack samples were in, the most frequent first (count x frames),
- the worker's full collections: how many, the most objects and the longest.

    python3 tools/device/gap16_first_use.py cycle.log[.gz] [--slow-ms 300] [--frames 4]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import re

STEP = re.compile(r"(gpu\d+) step (\d+): (\d+) tokens, ([\d.]+) ms")
SAMPLE = re.compile(r"(gpu\d+): step (\d+) running for (\d+) ms: (.*)$")
REPORT = re.compile(r"(gpu\d+): step (\d+) took [\d.]+ ms; kernels loaded / compiled since the last report: (.*)$")
KERNELS = re.compile(r"((?:gpu\d+|vision worker) kernels: .*)$")
GC2 = re.compile(r"(gpu\d+): a garbage collection of generation 2 took ([\d.]+) ms \((\d+) objects collected\)")


def opened(path: str):
    return gzip.open(path, "rt", errors="replace") if path.endswith(".gz") else open(path, errors="replace")


def read(path: str, slow_ms: float, frames: int) -> list[str]:
    starts, steps, gcs = [], [], []
    samples: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    reports: dict[tuple, str] = {}
    with opened(path) as f:
        for line in f:
            if (m := STEP.search(line)) and float(m.group(4)) > slow_ms:
                steps.append((m.group(1), int(m.group(2)), int(m.group(3)), float(m.group(4))))
            elif m := SAMPLE.search(line):
                inner, _, own = m.group(4).partition(" | ")  # the innermost frames | moebus's own innermost
                samples[m.group(1), int(m.group(2))][" < ".join(inner.split(" < ")[:frames]) +
                                                     (f" | {own}" if own else "")] += 1
            elif m := REPORT.search(line):
                reports[m.group(1), int(m.group(2))] = m.group(3)
            elif m := KERNELS.search(line):
                starts.append(m.group(1))
            elif m := GC2.search(line):
                gcs.append((float(m.group(2)), int(m.group(3))))
    out = [f"starts: {s}"[:400] for s in starts]
    for gpu, step_id, tokens, ms in steps:
        out.append(f"{gpu} step {step_id}: {tokens} tokens, {ms:.0f} ms; kernels +loaded/+compiled: "
                   f"{reports.get((gpu, step_id), '?')}"[:400])
        for where, count in samples[gpu, step_id].most_common(4):
            out.append(f"  {count} x {where}"[:300])
    out.append(f"{len(steps)} steps over {slow_ms:.0f} ms; full collections: {len(gcs)}" +
               (f", at most {max(n for _, n in gcs)} objects, the longest {max(ms for ms, _ in gcs):.1f} ms"
                if gcs else ""))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--slow-ms", type=float, default=300.0)
    p.add_argument("--frames", type=int, default=4, help="innermost frames a sample is grouped by")
    args = p.parse_args()
    print("\n".join(read(args.log, args.slow_ms, args.frames)))


if __name__ == "__main__":
    main()
