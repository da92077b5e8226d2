"""On the GPU: the decode step replayed as CUDA graphs gives the same tokens and logprobs as the
eager path, and a cache of 25% of the experts (misses read from mapped host memory) the same as all
resident. Usage: graph_check.py MODEL_DIR"""
import os
import sys
import time

import numpy as np

from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

model_dir = sys.argv[1]
prompt = [5, 17, 99, 3, 42, 7, 250, 31, 8]


def run(graphs: bool, fraction=None, batch=1, tokens=24):
    os.environ["MOEBUS_CUDA_GRAPHS"] = "1" if graphs else "0"
    model = LocalModel(model_dir, device="cuda", num_slots=batch, max_context=64, cache_fraction=fraction)
    assert all(s.use_graphs == graphs for s in model.stages)
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(prompt)] * batch,
                         tokens=prompt * batch))
    out_tokens, out_lp, last = [], [], [prompt[-1] + s for s in range(batch)]
    t = time.perf_counter()
    for i in range(tokens):
        out = model.step(StepBatch(slots=range(batch), starts=[len(prompt) + i] * batch, lengths=[1] * batch,
                                   tokens=last))
        last = [int(x) for x in out.tokens]
        out_tokens.append(last)
        out_lp.append(out.logprobs.copy())
    dt = time.perf_counter() - t
    stats = model.stages[0].experts.stats()
    del model
    return np.array(out_tokens), np.array(out_lp), dt, stats


ok = True
for batch in (1, 8):
    eager = run(False, batch=batch)
    graph = run(True, batch=batch)
    small = run(True, 0.25, batch=batch)
    for name, other in (("graph", graph), ("graph+25%cache", small)):
        same = np.array_equal(eager[0], other[0])
        dlp = float(np.abs(eager[1] - other[1]).max())
        ok &= same and dlp == 0.0
        print(f"batch {batch} {name} vs eager: same tokens {same}, max |dlogprob| {dlp:.2e}, "
              f"{other[2]:.3f}s vs {eager[2]:.3f}s for 24 steps; hits {other[3]['hits']} misses {other[3]['misses']}")
print("GRAPH CHECK", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
