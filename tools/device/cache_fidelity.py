"""Greedy tokens and logprobs with the expert cache at 100% and at 10% of the experts (elastic VMM
arena with 2 MiB segments, misses on a copy stream), on one device. Usage: cache_fidelity.py DIR DEVICE"""
import sys
import time

import numpy as np

from moebus.workers.local import LocalModel

model_dir, device = sys.argv[1], sys.argv[2]
prompt = [5, 17, 99, 3, 42, 7, 250, 31, 8]
full = LocalModel(model_dir, device=device)
t = time.time()
a = full.generate(prompt, 32)
full_s = time.time() - t
small = LocalModel(model_dir, device=device, cache_fraction=0.10, elastic=True)
ckpt, layers, cache = small.ckpt, range(small.ckpt.config.num_layers), small.stages[0].experts
t = time.time()
b = small.generate(prompt, 32)
small_s = time.time() - t
same_tokens = a.tokens == b.tokens
max_dlogprob = float(np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max())
print(f"cache fidelity on {device}: slots {cache.num_slots} of {ckpt.config.num_experts * len(layers)}, "
      f"misses {cache.misses}, hits {cache.hits}, same tokens {same_tokens}, max |dlogprob| {max_dlogprob:.2e}, "
      f"identical logprobs {a.logprobs == b.logprobs}, 32 tokens in {full_s:.2f}s (100%) / {small_s:.2f}s (10%)")
sys.exit(0 if same_tokens and max_dlogprob == 0.0 else 1)
