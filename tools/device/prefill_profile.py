"""Host time of one long prefill step on cuda: cProfile of LocalModel.step (after a warm-up), the
functions that took the most time themselves. Usage: prefill_profile.py MODEL_DIR TOKENS"""
import cProfile
import pstats
import sys
import time

from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

model_dir, num_tokens = sys.argv[1], int(sys.argv[2])
model = LocalModel(model_dir, device="cuda", num_slots=1, max_context=num_tokens + 8)
batch = StepBatch(slots=[0], starts=[0], lengths=[num_tokens], tokens=[(7 * i + 3) % 1000 + 10 for i in range(num_tokens)])
model.step(batch)
start = time.perf_counter()
model.step(batch)
print(f"step of {num_tokens} tokens: {time.perf_counter() - start:.3f} s (unprofiled)")
profile = cProfile.Profile()
profile.enable()
model.step(batch)
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(22)
