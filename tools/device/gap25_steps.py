"""The decode steps through a cold image, in bins of time (issue 20, twenty-fifth session): reads a
``moebus bench vision-cycle -v`` log run with ``MOEBUS_LOG_STEPS=1`` (the worker's step lines carry the
step's misses and MiB over PCIe since this session) and prints, for each BIN ms after the image was
sent, the decode steps' count, median and max ms, and mean misses and MiB a step, with the cold start's
phases (the bench's split of the measured request) and the vision worker's context (from its start
line) marked. Tells whether the slow steps after the hand-back miss more (the cache) or not (the
other context's start beside them).

    python3 tools/device/gap25_steps.py cycle.log[.gz] [--bin-ms 50] [--until-ms 1200]
"""
from __future__ import annotations

import argparse
import gzip
import re
import statistics

from gap15_gaps import SENT, STAMP, seconds  # beside this script: the log's stamps and the image's send line

SPLIT = re.compile(r"^cold image request (\d+) of (\d+): handback ([\d.]+) ms, start ([\d.]+) ms, encode ([\d.]+) ms")
STEP = re.compile(r"gpu\d+ step \d+: (\d+) tokens, ([\d.]+) ms, -?[\d.]+ ms after the last(?:; (\d+) misses, ([\d.]+) MiB)?")
CONTEXT = re.compile(r"vision worker start on gpu\d+: .*context ([\d.]+) s")


def read(path: str):
    """(sent s, phase ends ms, [(ms after sent, step ms, misses, MiB, tokens)], [(ms, label)])."""
    sent, ends, steps, marks = None, None, [], []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        lines = f.readlines()
    for line in lines:
        if (m := SENT.search(line)) and not line[:4].isdigit():
            sent = seconds(m.group(1))
        elif (m := SPLIT.match(line)) and m.group(1) == m.group(2):
            hb, st, en = (float(m.group(i)) for i in (3, 4, 5))
            ends = {"handback": hb, "start": hb + st, "encode": hb + st + en}
    if sent is None:
        raise SystemExit(f"{path}: no 'the image was sent at' line (not a -v vision-cycle log?)")
    for line in lines:
        if not (m := STAMP.match(line)):
            continue
        ms = 1e3 * (seconds(m.group(1)) - sent)
        if (s := STEP.search(line)):
            misses = int(s.group(3)) if s.group(3) else None
            mib = float(s.group(4)) if s.group(4) else None
            steps.append((ms, float(s.group(2)), misses, mib, int(s.group(1))))
        elif (c := CONTEXT.search(line)):
            marks.append((ms, f"vision worker ready (its context took {1e3 * float(c.group(1)):.0f} ms before)"))
        elif "encode 1:" in line and "tower" in line:
            marks.append((ms, "first encode done"))
    return ends, steps, marks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--bin-ms", type=float, default=50.0)
    ap.add_argument("--from-ms", type=float, default=-200.0)
    ap.add_argument("--until-ms", type=float, default=1200.0)
    args = ap.parse_args()
    ends, steps, marks = read(args.log)
    if ends:
        print("phases end (ms after sent): " + ", ".join(f"{k} {v:.0f}" for k, v in ends.items()))
    for ms, label in marks:
        print(f"{ms:7.0f} ms: {label}")
    print(f"{'bin ms':>11} {'steps':>5} {'median':>7} {'max':>6} {'misses':>7} {'MiB':>6}   (decode steps: one token a row)")
    lo = args.from_ms
    while lo < args.until_ms:
        hi = lo + args.bin_ms
        got = [s for s in steps if lo <= s[0] < hi and s[4] <= 8]
        if got:
            ms = [s[1] for s in got]
            miss = [s[2] for s in got if s[2] is not None]
            mib = [s[3] for s in got if s[3] is not None]
            mean = (lambda v, f: f % statistics.fmean(v) if v else "-")
            phase = "" if not ends else "before" if hi <= 0 else next((k for k, v in ends.items() if lo < v), "after")
            print(f"{lo:5.0f}-{hi:<5.0f} {len(got):5d} {statistics.median(ms):7.2f} {max(ms):6.2f} "
                  f"{mean(miss, '%7.1f'):>7} {mean(mib, '%6.0f'):>6}   {phase}")
        lo = hi


if __name__ == "__main__":
    main()
