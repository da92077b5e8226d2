"""Precision of the next-layer predictor by predicted rank (eager, cpu by default): of the experts
layer L+1's router ranks r-th on layer L's MLP input, how many does layer L+1 then choose? (As
decode_predict.py, which gives recall.) Usage: [DEVICE=cpu] prefetch6_precision.py MODEL STEPS BATCH"""
import os
import sys

import numpy as np
from moebus.cuda.dtypes import to_f32
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(32)]
model_dir, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = LocalModel(model_dir, device=os.environ.get("DEVICE", "cpu"), num_slots=batch, max_context=128)
cfg, ops = model.ckpt.config, model.backend
seen = []
original = ops.norm_route


def recording(*args):
    out = original(*args)
    seen.append((args[8], ops.to_host(out[1]), ops.to_host(out[2])))  # (layer row, h, chosen ids)
    return out


ops.norm_route = recording
model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(PROMPT)] * batch, tokens=PROMPT * batch))
seen.clear()
last = [PROMPT[-1] + s for s in range(batch)]
for i in range(steps):
    out = model.step(StepBatch(slots=range(batch), starts=[len(PROMPT) + i] * batch, lengths=[1] * batch, tokens=last))
    last = [int(t) for t in out.tokens]
rows = model.stages[0].experts.store.row_of_layer
routers = {row: to_f32(model.ckpt.router(layer)) for layer, row in rows.items()}
k = cfg.top_k
right, count = np.zeros(k), 0
for (row, h, _), (next_row, _, next_ids) in zip(seen, seen[1:]):
    if next_row != row + 1:
        continue
    predicted = np.argsort(-(h @ routers[next_row].T), axis=1, kind="stable")[:, :k]
    for p, c in zip(predicted, next_ids):
        right += [e in set(c.tolist()) for e in p]
        count += 1
print(f"{count} (token, layer) pairs; precision by predicted rank:", " ".join(f"{v / count:.2f}" for v in right))
print("cumulative precision of the top-r:", " ".join(f"{right[:r].sum() / (r * count):.2f}" for r in range(1, k + 1)))
