"""What a `bench vision-cycle -v --cold-starts 2` log (gap12.sh's cycles) says of the measured cold
start's spanning chunks, for issue 20's prefill gaps: each chunk's "done" line in full (its steps'
host time by part and its slowest steps by part, spanning_chunk.py), and the cuBLAS calls that took
more host time than gemm_host.SLOW_CALL_S (a kernel loaded at its first launch): how many at the
worker's start (before READY) and how many, with their shapes, in the measured cold start (placed in
ms after its hand-back's first VRAM step, as tools/device/gap6_logs.py places the bench's gaps).

    python3 tools/device/gap12.py CYCLE_LOG"""
from __future__ import annotations

import re
import sys

from gap6_logs import measured

DONE = re.compile(r"a prompt chunk of \d+ tokens .* done in .*")
SLOW = re.compile(r"cuBLAS (\w+) m (\d+) n (\d+) k (\d+) batch (\d+) took ([\d.]+) ms")
MAX_LINES = 16


def main(path: str) -> None:
    rows, origin = measured(path)
    ready = next((t for t, text in rows if " ready: layers " in text), None)
    slow = [(t, SLOW.search(text)) for t, text in rows if SLOW.search(text)]
    at_start = [m for t, m in slow if ready is not None and t <= ready]
    print(f"slow cuBLAS calls: {len(at_start)} before the worker's READY "
          f"({sum(float(m.group(6)) for m in at_start):.0f} ms), {len(slow) - len(at_start)} after")
    if origin is None:
        print("no measured cold start found (no hand-back VRAM step after the first regrow)")
        return
    later = [(t, m) for t, m in slow if t >= origin - 0.2]
    print(f"  in the measured cold start: {len(later)}, {sum(float(m.group(6)) for _, m in later):.0f} ms of host time")
    for t, m in later[:MAX_LINES]:
        kind, mm, n, k, batch, took = m.groups()
        print(f"  {1e3 * (t - origin):8.0f} ms  {kind} m {mm} n {n} k {k} batch {batch}: {took} ms")
    for t, text in rows:
        if t >= origin - 0.2 and DONE.search(text):
            done = DONE.search(text).group(0)
            print(f"  {1e3 * (t - origin):8.0f} ms  " + re.sub(r" \(slot \d+, from \d+\)|, host time to its reply, "
                                                               r"with the decode rows", "", done))


if __name__ == "__main__":
    main(sys.argv[1])
