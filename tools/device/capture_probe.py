"""On the GPU: what a decode step of a batch size never seen before costs (its graph capture, and
any kernel compiled for it), size by size, plain and with a grammar mask, in one process.
Usage: capture_probe.py MODEL_DIR [MAX_BATCH]. Prints one row per (batch size, masked): the first
step's ms, the second's, and the kernel cache files the first step wrote (compiles)."""
import os
import sys
import time
from pathlib import Path

import numpy as np

from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

model_dir, max_batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
cache = Path(os.environ.get("NUMBA_CACHE_DIR", "/tmp/numba-probe"))
os.environ.setdefault("NUMBA_CACHE_DIR", str(cache))
prompt = [5, 17, 99, 3, 42, 7, 250, 31, 8]


def cache_files() -> int:
    return sum(1 for _ in cache.rglob("*.nbc")) if cache.exists() else 0


t0 = time.perf_counter()
model = LocalModel(model_dir, device=os.environ.get("PROBE_DEVICE", "cuda"), num_slots=max_batch, max_context=512, kv_dtype="bf16")
print(f"load {time.perf_counter() - t0:.1f}s")
vocab = model.ckpt.config.vocab_size
words = -(-vocab // 32)
t0 = time.perf_counter()
model.step(StepBatch(slots=range(max_batch), starts=[0] * max_batch, lengths=[len(prompt)] * max_batch,
                     tokens=prompt * max_batch))
print(f"prefill {1e3 * (time.perf_counter() - t0):.0f} ms, cache files {cache_files()}")
pos = len(prompt)
print(f"{'batch':>5} {'masked':>6} {'first_ms':>9} {'second_ms':>9} {'third_ms':>9} {'compiled':>8}")
for masked in (False, True):
    for n in range(1, max_batch + 1):
        times, before = [], cache_files()
        for _ in range(3):
            extra = {}
            if masked:
                mask = np.full((1, words), 0xFFFFFFFF, np.uint32)
                extra = {"mask": mask, "mask_rows": np.array([0] + [-1] * (n - 1), np.int32)}
            batch = StepBatch(slots=range(n), starts=[pos] * n, lengths=[1] * n, tokens=[7] * n,
                              temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, u=[0.5] * n, **extra)
            t = time.perf_counter()
            model.step(batch)
            times.append(1e3 * (time.perf_counter() - t))
            pos += 1
        print(f"{n:>5} {str(masked):>6} {times[0]:>9.1f} {times[1]:>9.2f} {times[2]:>9.2f} {cache_files() - before:>8}")
stage = model.stages[0]
print(f"graph_captures {stage.graph_captures} eager_short_steps {stage.eager_short_steps}")
