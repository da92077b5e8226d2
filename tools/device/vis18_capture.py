"""The text steps that ran beside the vision worker's deferred tower capture (issue 20, seventeenth session,
branch vis17, second round): reads a ``moebus bench vision-cycle -v`` log with MOEBUS_LOG_STEPS=1 (gap12.sh's
cycle) and, for each vision worker's first encode, prints the capture's line (its ms and parts: pinned
buffers, launches recorded, instantiation) and the text steps whose time overlapped the window after the
encode's reply: the capture's own (its line is stamped at its end) or, where no capture followed within
1 s (MOEBUS_TOWER_CAPTURE_WHEN=idle / next), the same length after the reply (WINDOW_MS, 60). Beside them
the median of the steps of the same kind (2-token decode, or a prompt chunk) in the second after the window,
so a run with the capture and one without read alike. A log line is stamped when it is written: a step's at
its end, the encode's as its reply goes.

    python3 tools/device/vis18_capture.py cycle.log[.gz] [--tag off] [--min-beside 3] [--short]
"""
from __future__ import annotations

import argparse
import gzip
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gap15_gaps import STAMP, STEP, seconds  # noqa: E402

ENCODE = re.compile(r"encode 1: .*tower ([\d.]+) ms \(([^)]*)\)")
CAPTURE = re.compile(r"tower graph of the last image size captured (.*?): ([\d.]+) ms(?: \((.*)\))?$")
WINDOW_MS = 60.0
AFTER_S = 1.0


def read(path: str):
    """(encodes as (time, line), captures as (time, when, ms, parts), steps as (end, ms, tokens, id))."""
    encodes, captures, steps = [], [], []
    opened = gzip.open(path, "rt", errors="replace") if path.endswith(".gz") else open(path, errors="replace")
    with opened as f:
        for line in f:
            m = STAMP.match(line)
            if not m:
                continue
            t, text = seconds(m.group(1)), m.group(3)
            if (e := ENCODE.search(text)) and m.group(2).startswith("moebus.vision"):
                encodes.append((t, f"tower {e.group(1)} ms ({e.group(2)})"))
            elif c := CAPTURE.search(text):
                captures.append((t, c.group(1), float(c.group(2)), c.group(3) or ""))
            elif s := STEP.search(text):
                steps.append((t, float(s.group(4)), int(s.group(3)), int(s.group(2))))
    return encodes, captures, steps


def kind(tokens: int) -> str:
    return "decode" if tokens <= 4 else "chunk"


PART = re.compile(r"(staging pinned|launches recorded|instantiated \(and the rest\)|outputs pinned) ([\d.]+) ms")


def short_parts(parts: str) -> str:
    """"pin 0.4 / rec 40.1 / inst 15.2 / out 1.1" out of DeferredCapture.parts."""
    names = {"staging pinned": "pin", "launches recorded": "rec", "instantiated (and the rest)": "inst",
             "outputs pinned": "out"}
    return " / ".join(f"{names[n]} {v}" for n, v in PART.findall(parts)) or "no parts"


def report(path: str, tag: str, min_beside: int = 0) -> tuple[list[str], list[str]]:
    """(the long lines, one short line an encode) for each vision worker's first encode with at least
    ``min_beside`` text steps beside its window (the cold start under load, not a lone image)."""
    encodes, captures, steps = read(path)
    out, short = [], []
    for i, (t_enc, what) in enumerate(encodes):
        t_next = encodes[i + 1][0] if i + 1 < len(encodes) else float("inf")
        capture = next((c for c in captures if t_enc <= c[0] <= t_enc + AFTER_S), None)
        later = next((c for c in captures if t_enc + AFTER_S < c[0] < t_next), None)
        if capture is not None:
            t_end, start = capture[0], capture[0] - capture[2] / 1e3
            how = f"captured {capture[1]} {capture[2]:.1f} ms"
            brief, parts = f"capture {capture[2]:.1f} ms", capture[3] or "no parts"
        else:
            start, t_end = t_enc, t_enc + WINDOW_MS / 1e3
            how = f"no capture within {AFTER_S:.0f} s (a window of {WINDOW_MS:.0f} ms after the reply)"
            brief = f"no capture in {AFTER_S:.0f} s"
            if later is not None:
                how += f"; captured {later[1]} +{later[0] - t_enc:.2f} s after the reply: {later[2]:.1f} ms"
                brief += f", one +{later[0] - t_enc:.1f} s later {later[2]:.1f} ms"
            parts = later[3] if later is not None and later[3] else ""
        beside = [s for s in steps if s[0] > start and s[0] - s[1] / 1e3 < t_end]
        if len(beside) < min_beside:
            continue
        after = [s for s in steps if t_end + 0.05 < s[0] <= t_end + 0.05 + AFTER_S]
        medians = {}
        for k in ("decode", "chunk"):
            ms = [s[1] for s in after if kind(s[2]) == k]
            if ms:
                medians[k] = statistics.median(ms)
        listed = ", ".join(f"{s[3]} {s[2]}t {s[1]:.1f}" for s in beside) or "none"
        worst = max((s[1] - medians.get(kind(s[2]), s[1]) for s in beside), default=0.0)
        med = ", ".join(f"{k} {v:.1f}" for k, v in medians.items()) or "none"
        head = f"{tag} encode {i + 1} at +{t_enc - encodes[0][0]:.2f} s, {what}: {how}"
        out.append(head + (f" ({parts})" if parts else ""))
        out.append(f"  steps beside (id tokens ms): {listed}; medians in the {AFTER_S:.0f} s after: {med}; "
                   f"the worst over its kind's median {worst:+.1f} ms")
        short.append(f"{tag} #{i + 1}: {what}; {brief} ({short_parts(parts)}); {len(beside)} steps beside, max "
                     f"{max((s[1] for s in beside), default=0):.1f}, worst {worst:+.1f} ms over ({med})")
    return out or [f"{tag}: no encode 1 line with {min_beside} steps beside"], short or [f"{tag}: no such encode"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--tag", default="")
    parser.add_argument("--min-beside", type=int, default=0, help="only encodes with this many steps beside")
    parser.add_argument("--short", action="store_true", help="one line an encode")
    args = parser.parse_args()
    out, short = report(args.log, args.tag or Path(args.log).name, args.min_beside)
    print("\n".join(short if args.short else out))


if __name__ == "__main__":
    main()
