"""On the GPU (issue 19): prefill of one prompt in one step as `moebus bench prefill` times it
(bench/prefill.py: a warm-up, then REPEATS runs; the figure is their median), all experts resident
and through a partial cache, in one process per cache so that the two 2048-token figures of the
seventh session (bench prefill 3,457 tok/s, prefill_cache_check.py 5,984) can be told apart: both
prompts (bench's and the check's, which uses 200 distinct ids) in the same process, every run printed.
Usage: tc8_prefill.py MODEL [TOKENS=2048] [REPEATS=5] [FRACTIONS=1,0.25] [LONG=8192]"""
import statistics
import sys

from moebus.bench.prefill import bench_prompt, prefill_flops, prefill_times
from moebus.workers.local import LocalModel


def main() -> None:
    model_dir = sys.argv[1]
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    fractions = [float(f) for f in (sys.argv[4] if len(sys.argv) > 4 else "1,0.25").split(",")]
    long = int(sys.argv[5]) if len(sys.argv) > 5 else 8192
    rows = []
    for fraction in fractions:
        lengths = [tokens] + ([long] if fraction >= 1 and long else [])
        model = LocalModel(model_dir, device="cuda", num_slots=1, max_context=max(lengths) + 16,
                           cache_fraction=None if fraction >= 1 else fraction, kv_dtype="bf16")
        cfg = model.ckpt.config
        prompts = {"bench": lambda n: bench_prompt(n, cfg.vocab_size),
                   "check": lambda n: [(37 * i + 11) % 200 + 10 for i in range(n)]}
        for n in lengths:
            for name, make in prompts.items() if n == tokens else [("bench", prompts["bench"])]:
                before = model.stages[0].experts.stats()["misses"]
                times = prefill_times(model, make(n), repeats if n == tokens else 3)
                misses = (model.stages[0].experts.stats()["misses"] - before) / (len(times) + 1)
                median = statistics.median(times)
                row = dict(cache=fraction, tokens=n, prompt=name, median_ms=round(median * 1e3, 1),
                           min_ms=round(min(times) * 1e3, 1), tok_s=round(n / median), best_tok_s=round(n / min(times)),
                           tflop_s=round(prefill_flops(cfg, n) / median / 1e12, 1), misses_per_step=round(misses),
                           runs_ms=[round(t * 1e3, 1) for t in times])
                rows.append(row)
                print(row, flush=True)
        del model
    print(f"{'cache':>5} {'tokens':>6} {'prompt':>6} {'median ms':>9} {'min ms':>7} {'tok/s':>7} {'best':>7} "
          f"{'TFLOP/s':>7} {'misses':>6}  runs")
    for r in rows:
        print(f"{r['cache']:>5} {r['tokens']:>6} {r['prompt']:>6} {r['median_ms']:>9} {r['min_ms']:>7} {r['tok_s']:>7} "
              f"{r['best_tok_s']:>7} {r['tflop_s']:>7} {r['misses_per_step']:>6}  {r['runs_ms']}")


if __name__ == "__main__":
    main()
