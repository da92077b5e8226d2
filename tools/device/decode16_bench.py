"""A `moebus bench` command (decode, decode-context, ...: moebus.bench.<NAME>.main) with constants of
moebus.cuda.kernels set first (decode13_bench's "module.NAME=VALUE", e.g. "attention_decode.DECODE_TC=0"), so
one setting of the decode attention is timed end to end in a process of its own (its graphs capture the kernels
of that setting). decode14_context.py is this for decode-context.

    decode16_bench.py NAME [KEY=VALUE ...] -- BENCH_ARGS..."""
import importlib
import sys

from decode13_bench import apply

if __name__ == "__main__":
    cut = sys.argv.index("--")
    apply(sys.argv[2:cut])
    print("settings:", " ".join(sys.argv[2:cut]) or "defaults", flush=True)
    sys.exit(importlib.import_module(f"moebus.bench.{sys.argv[1].replace('-', '_')}").main(sys.argv[cut + 1:]))
