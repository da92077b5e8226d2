"""A cycle log's decode steps against their misses (issue 20, thirty-sixth session): reads a ``moebus bench
vision-cycle -v`` log with ``MOEBUS_LOG_STEPS=1`` and fits each 2-token step's ms as a + b * misses + c * admissions
(admissions: the step's MiB over PCIe / the expert's MiB - its misses), then prints, for the second before the image
was sent, the 1.3 s after it and the whole run: the steps' median and max ms, their misses' median and max, and the
residuals' p50 / p90 / p99 / max: what the routing explains and what the machine adds.

    python3 tools/device/resid41.py cycle.log[.gz] [--expert-mib 9]
"""
from __future__ import annotations

import argparse
import gzip
import re

import numpy as np
from gap15_gaps import SENT, seconds  # beside this script: the image's send line, the log's stamps

STEP = re.compile(r"^(\S+ \S+) .*step \d+: 2 tokens, ([\d.]+) ms, ([-\d.]+) ms after the last; (\d+) misses, "
                  r"([\d.]+) MiB")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("log")
    p.add_argument("--expert-mib", type=float, default=9.0, help="an expert's MiB as the step line counts it")
    args = p.parse_args()
    rows, sent = [], None
    opener = gzip.open if args.log.endswith(".gz") else open
    with opener(args.log, "rt", errors="replace") as f:
        for line in f:
            if sent is None and not line[:4].isdigit() and (m := SENT.search(line)):
                sent = seconds(m.group(1))
            elif m := STEP.match(line):
                rows.append((seconds(m.group(1)),) + tuple(float(x) for x in m.groups()[1:]))
    if len(rows) < 10:
        print(f"{args.log}: {len(rows)} 2-token steps logged (MOEBUS_LOG_STEPS=1?)")
        return
    a = np.array(rows)
    misses, admissions = a[:, 3], np.maximum(a[:, 4] / args.expert_mib - a[:, 3], 0)
    x = np.c_[misses, admissions, np.ones(len(a))]
    coef = np.linalg.lstsq(x, a[:, 1], rcond=None)[0]
    resid = a[:, 1] - x @ coef
    print(f"steps ms = {coef[2]:.2f} + {coef[0]:.3f} x misses + {coef[1]:.3f} x admissions ({len(a)} steps)")
    t = a[:, 0] - (sent if sent is not None else a[-1, 0] + 1)
    for name, sel in (("1 s before the image", (t > -1.1) & (t < -0.1)), ("1.3 s after it", (t > 0) & (t < 1.3)),
                      ("the whole run", t == t)):
        if sel.sum() < 5:
            continue
        r, s, m = resid[sel], a[sel, 1], misses[sel]
        print(f"  {name}: {sel.sum()} steps, ms median {np.median(s):.2f} max {s.max():.2f}, misses median "
              f"{np.median(m):.0f} max {m.max():.0f}; residual p50/p90/p99/max "
              + " / ".join(f"{v:+.2f}" for v in np.percentile(r, [50, 90, 99, 100])))


if __name__ == "__main__":
    main()
