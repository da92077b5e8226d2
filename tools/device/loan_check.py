"""The prompt-path loan on a GPU: a prompt longer than the standing scratch, with the expert cache
lending slots (and the step running in pieces when they are short), gives the logits of one
unconstrained pass. Usage: loan_check.py MODEL_DIR"""
import sys

import numpy as np

from moebus.workers.batch import StepBatch
from moebus.workers.cache_sizing import ScratchBudget
from moebus.workers.local import LocalModel

model_dir = sys.argv[1]
full = LocalModel(model_dir, device="cuda", max_context=1024)
prompts = [list(range(10, 400)), list(range(500, 520))]
want = full.prefill_logits(prompts)
small = LocalModel(model_dir, device="cuda", max_context=1024, cache_fraction=1 / 8, elastic=True)
stage = small.stages[0]
cache = stage.experts
stage.scratch = ScratchBudget(stage.cfg, tokens=8)
batch = StepBatch(slots=[0, 1], starts=[0, 0], lengths=[len(p) for p in prompts], tokens=sum(prompts, []))
lent = (cache.num_slots - cache.min_slots) * cache.arena.slot_bytes
pieces = stage.scratch.tokens_within(lent) < batch.num_tokens
got = small.step(batch, want_logits=True).logits
err = float(np.abs(got - want).max())
print(f"loan check on cuda: {batch.num_tokens} tokens, {cache.num_slots} slots, in pieces: {pieces}, "
      f"max |dlogit| {err:.2e}, loan returned: {cache.loaned_from is None}")
sys.exit(0 if err < 1e-3 and cache.loaned_from is None else 1)
