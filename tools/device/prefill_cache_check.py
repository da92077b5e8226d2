"""On the GPU: a long prompt through a partial expert cache gives what it gives with every expert
resident (same greedy tokens, bit-identical logprobs), i.e. the prefill's copies that overlap the
layer before never overwrite a slot still being read. Then the prefill's time at each fraction.
Usage: prefill_cache_check.py MODEL [TOKENS] [FRACTION,...]"""
import sys
import time

import numpy as np

from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel
from decode_tokens import decode_tokens  # noqa: E402 - beside this script

model_dir = sys.argv[1]
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
fractions = [float(f) for f in (sys.argv[3] if len(sys.argv) > 3 else "0.5,0.25").split(",")]
prompt = [(37 * i + 11) % 200 + 10 for i in range(tokens)]
results, ok = {}, True
for fraction in [None] + fractions:
    model = LocalModel(model_dir, device="cuda", num_slots=1, max_context=tokens + 16, cache_fraction=fraction,
                       kv_dtype="bf16")
    out = decode_tokens(model, prompt, 1, 8)
    times = []
    for _ in range(2):  # the prefill alone, timed (the first run above compiled and warmed)
        t = time.perf_counter()
        model.step(StepBatch(slots=[0], starts=[0], lengths=[tokens], tokens=prompt))
        times.append(time.perf_counter() - t)
    stats = model.stages[0].experts.stats()
    results[fraction] = out
    label = "all resident" if fraction is None else f"cache {fraction:.2f}"
    line = f"{label}: prefill {tokens} in {min(times) * 1e3:.1f} ms ({tokens / min(times):,.0f} tok/s), misses {stats['misses']}"
    if fraction is not None:
        same = np.array_equal(out[0], results[None][0])
        dlp = float(np.abs(out[1] - results[None][1]).max())
        ok &= same and dlp == 0.0
        line += f"; vs all resident: same tokens {same}, max |dlogprob| {dlp:.1e}"
    print(line, flush=True)
    del model
print("PREFILL CACHE CHECK", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
