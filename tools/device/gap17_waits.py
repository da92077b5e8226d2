"""How long the worker waited before each step (MOEBUS_LOG_STEPS=1's "gpu0 step N: T tokens, X ms, Y ms
after the last" lines), chunk steps (more than --chunk-tokens tokens) against the others: the sixteenth
session's call A had a chunk step wait a median 4.89 ms (its 6.2 MB feed again, after the look-ahead
step's reply), every other step 0.14 ms. Also the steps the worker's link took over 1 ms to decode
(MOEBUS_LOG_DECODE_MS=1) and any step failed for a held chunk the worker did not hold.
    python3 tools/device/gap17_waits.py LOG[.gz] [--tag TAG]"""
import argparse
import gzip
import re
import statistics

STEP = re.compile(r"gpu\d+ step (\d+): (\d+) tokens, ([\d.]+) ms, (-?[\d.]+) ms after the last")
DECODED = re.compile(r"Step of ([\d.]+) MB decoded in ([\d.]+) ms")


def figures(values: list) -> str:
    if not values:
        return "none"
    return f"{len(values)}: median {statistics.median(values):.2f}, max {max(values):.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log")
    p.add_argument("--tag", default="")
    p.add_argument("--chunk-tokens", type=int, default=16)
    args = p.parse_args(argv)
    opener = gzip.open if args.log.endswith(".gz") else open
    chunk_wait, other_wait, chunk_ms, decoded, unheld = [], [], [], [], 0
    with opener(args.log, "rt", errors="replace") as f:
        for line in f:
            if m := STEP.search(line):
                tokens, ms, waited = int(m.group(2)), float(m.group(3)), float(m.group(4))
                if waited >= 0:
                    (chunk_wait if tokens > args.chunk_tokens else other_wait).append(waited)
                if tokens > args.chunk_tokens:
                    chunk_ms.append(ms)
            elif m := DECODED.search(line):
                decoded.append(float(m.group(2)))
            elif "that this stage does not hold" in line:
                unheld += 1
    print(f"{args.tag}: waited before a chunk step (ms) {figures(chunk_wait)}; before another {figures(other_wait)}")
    print(f"  chunk steps' own ms {figures(chunk_ms)}; steps decoded over 1 ms {figures(decoded)}; "
          f"steps failed for a chunk not held: {unheld}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
