"""The worker's steps through an image prompt's spanning chunk (MOEBUS_LOG_STEPS=1's "gpu0 step N: T
tokens, X ms" lines): in the longest run of steps of more than --chunk-tokens tokens (at most 4 steps
apart), the chunk's steps against the decode-only steps between them, and the decode steps before (the
90 ending 60 steps before the chunk's first), each n / median / p90 / max ms / how many over --over ms (issue 20's 2x the
text median: 11 ms). Call A (seventeenth session, both held-chunk switches on): chunk steps 41 / 14.7 /
18.4 / 29.5 / 40, decode-only steps in the prefill 40 / 11.4 / 14.4 / 15.9 / 25, before 90 / 4.4 / 7.2 / 8.7 / 0.
    python3 tools/device/gap17_steps.py LOG[.gz] [--tag TAG]"""
import argparse
import gzip
import re
import statistics

STEP = re.compile(r"gpu\d+ step (\d+): (\d+) tokens, ([\d.]+) ms")


def figures(values: list, over: float) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    return (f"{len(values)} / {statistics.median(values):.1f} / {ordered[int(0.9 * len(values))]:.1f} / "
            f"{ordered[-1]:.1f} / {sum(v > over for v in values)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log")
    p.add_argument("--tag", default="")
    p.add_argument("--chunk-tokens", type=int, default=700)
    p.add_argument("--over", type=float, default=11.0)
    args = p.parse_args(argv)
    opener = gzip.open if args.log.endswith(".gz") else open
    steps = []  # (tokens, ms) in log order
    with opener(args.log, "rt", errors="replace") as f:
        for line in f:
            m = STEP.search(line)
            if m:
                steps.append((int(m[2]), float(m[3])))
    chunk = [i for i, (tokens, _) in enumerate(steps) if tokens > args.chunk_tokens]
    if not chunk:
        print(f"{args.tag}: no step of more than {args.chunk_tokens} tokens in {len(steps)} steps")
        return 0
    runs = [[chunk[0]]]  # the chunk steps in runs (at most 4 steps apart); the spanning chunk's is the longest
    for i in chunk[1:]:
        (runs[-1].append(i) if i - runs[-1][-1] <= 4 else runs.append([i]))
    run = max(runs, key=len)
    first = run[0]
    span = steps[first:run[-1] + 1]
    before = [ms for tokens, ms in steps[max(0, first - 150):max(0, first - 60)] if tokens < 16]
    print(f"{args.tag}: prefill steps: n / median / p90 / max ms / over {args.over:g}: chunk "
          f"{figures([ms for tokens, ms in span if tokens > args.chunk_tokens], args.over)}; decode-only "
          f"{figures([ms for tokens, ms in span if tokens < 16], args.over)}; decode before "
          f"{figures(before, args.over)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
