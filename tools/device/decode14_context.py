"""`moebus bench decode-context` with constants of moebus.cuda.kernels set first (decode13_bench's
"module.NAME=VALUE", e.g. "attention_decode.FAST_EXP=1"), so one setting of the decode attention is
timed end to end in a process of its own (the decode graph captures the kernel it compiles).

    decode14_context.py [KEY=VALUE ...] -- BENCH_ARGS..."""
import sys

from decode13_bench import apply
from moebus.bench.decode_context import main

if __name__ == "__main__":
    cut = sys.argv.index("--")
    apply(sys.argv[1:cut])
    print("settings:", " ".join(sys.argv[1:cut]) or "defaults", flush=True)
    sys.exit(main(sys.argv[cut + 1:]))
