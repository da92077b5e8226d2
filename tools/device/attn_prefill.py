"""Prefill of one prompt in one step (the tensor-core path) per KV cache dtype: median seconds of
2 after a warm-up, per length. The bf16 cache's attention runs two products per side instead of
three copies' worth (prefill_attention.py).
Usage: attn_prefill.py MODEL [LENGTHS] (default 2048,8192)"""
import statistics
import sys
import time

from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

model_dir = sys.argv[1]
lengths = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "2048,8192").split(",")]
for kv_dtype in ("bf16", "fp32"):
    model = LocalModel(model_dir, device="cuda", num_slots=1, max_context=max(lengths) + 8, kv_dtype=kv_dtype)
    for n in lengths:
        prompt = [(7 * i + 3) % 200 + 10 for i in range(n)]
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model.step(StepBatch(slots=[0], starts=[0], lengths=[n], tokens=prompt))
            times.append(time.perf_counter() - start)
        s = statistics.median(times[1:])
        print(f"PREFILL kv {kv_dtype} {n:>6} tokens: {s * 1e3:8.1f} ms = {n / s:8.0f} tok/s", flush=True)
    del model
