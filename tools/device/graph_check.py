"""On the GPU: the decode step replayed as CUDA graphs gives the same tokens and logprobs as the
eager path, and a cache of 25% of the experts (misses read from mapped host memory) the same as all
resident, and so do steps launched ahead (LocalModel.decode). Usage: graph_check.py MODEL_DIR [--no-cache]
(--no-cache: without the 25% cache's runs); EXPERTS_DTYPE, ATTENTION_DTYPE, LM_HEAD_DTYPE: the model's dtypes;
KV_DTYPE: the KV cache's (fp32, LocalModel's default; bf16: the tensor-core decode attention's)."""
import os
import sys

import numpy as np

from moebus.workers.local import LocalModel
from decode_tokens import decode_tokens, decode_tokens_ahead  # noqa: E402 - beside this script

model_dir = sys.argv[1]
with_cache = "--no-cache" not in sys.argv[2:]
prompt = [5, 17, 99, 3, 42, 7, 250, 31, 8]
# EXPERTS_DTYPE / ATTENTION_DTYPE / LM_HEAD_DTYPE: the model's dtypes (default bf16: as stored)
DTYPES = {f"{k.lower()}_dtype": os.environ.get(f"{k}_DTYPE", "bf16") for k in ("EXPERTS", "ATTENTION", "LM_HEAD")}
DTYPES["kv_dtype"] = os.environ.get("KV_DTYPE", "fp32")


def run(graphs: bool, fraction=None, batch=1, tokens=24, ahead=False):
    os.environ["MOEBUS_CUDA_GRAPHS"] = "1" if graphs else "0"
    model = LocalModel(model_dir, device="cuda", num_slots=batch, max_context=64, cache_fraction=fraction, **DTYPES)
    assert all(s.use_graphs == graphs for s in model.stages)
    out_tokens, out_lp, dt = (decode_tokens_ahead if ahead else decode_tokens)(model, prompt, batch, tokens)
    stats = model.stages[0].experts.stats()
    del model
    return out_tokens, out_lp, dt, stats


ok = True
for batch in map(int, os.environ.get("BATCHES", "1 8").split()):  # BATCHES: the batch sizes checked
    eager = run(False, batch=batch)
    graph = run(True, batch=batch)
    ahead = run(True, batch=batch, ahead=True)  # LocalModel.decode: each step launched before the last is read
    others = [("graph", graph), ("graph launched ahead", ahead)]
    if with_cache:
        others.append(("graph+25%cache", run(True, 0.25, batch=batch)))
    for name, other in others:
        same = np.array_equal(eager[0], other[0])
        dlp = float(np.abs(eager[1] - other[1]).max())
        ok &= same and dlp == 0.0
        print(f"batch {batch} {name} vs eager: same tokens {same}, max |dlogprob| {dlp:.2e}, "
              f"{other[2]:.3f}s vs {eager[2]:.3f}s for 24 steps; hits {other[3]['hits']} misses {other[3]['misses']}")
print("GRAPH CHECK", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
