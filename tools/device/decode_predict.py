"""How often layer L+1's router, run on layer L's MLP input, picks the experts layer L+1 really picks
(issue 15 item 2: a predictor for prefetching the next layer's misses). Greedy decode after a
32-token prompt, eager (the hook reads each layer's h on the host); for each pair of consecutive MoE
layers, recall = |predicted top-n & chosen top-k| / k, for n = k (prefetch as many as are used) and
n = k + 4. Usage: [DEVICE=cpu] decode_predict.py MODEL_DIR [STEPS] [BATCH]"""
import os
import sys

import numpy as np

os.environ["MOEBUS_CUDA_GRAPHS"] = "0"
from moebus.cuda.dtypes import to_f32  # noqa: E402
from moebus.workers.batch import StepBatch  # noqa: E402
from moebus.workers.local import LocalModel  # noqa: E402

PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(32)]


def main() -> None:
    model_dir = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    model = LocalModel(model_dir, device=os.environ.get("DEVICE", "cuda"), num_slots=batch, max_context=256)
    cfg, ops = model.ckpt.config, model.backend
    seen = []  # (layer row, h (T, D), ids (T, k)) of each decode layer, in order
    original = ops.norm_route

    def recording(x, y, norm_weight, eps, router, top_k, normalize, table, layer_row, ids):
        out = original(x, y, norm_weight, eps, router, top_k, normalize, table, layer_row, ids)
        seen.append((layer_row, ops.to_host(out[1]), ops.to_host(out[2])))
        return out

    ops.norm_route = recording
    model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[len(PROMPT)] * batch, tokens=PROMPT * batch))
    seen.clear()
    last = [PROMPT[-1]] * batch
    for i in range(steps):
        out = model.step(StepBatch(slots=range(batch), starts=[len(PROMPT) + i] * batch, lengths=[1] * batch,
                                   tokens=last))
        last = [int(t) for t in out.tokens]
    rows = model.stages[0].experts.store.row_of_layer  # one stage: every MoE layer's row
    routers = {row: to_f32(model.ckpt.router(layer)) for layer, row in rows.items()}
    k = cfg.top_k
    recall = {k: [], k + 4: []}
    per_layer = {}
    for (row, h, _), (next_row, _, next_ids) in zip(seen, seen[1:]):
        if next_row != row + 1:
            continue  # a new step (or a stage boundary)
        logits = h @ routers[next_row].T
        for n in recall:
            predicted = np.argsort(-logits, axis=1, kind="stable")[:, :n]
            hits = [len(set(p) & set(c)) / k for p, c in zip(predicted, next_ids)]
            recall[n] += hits
            if n == k:
                per_layer.setdefault(next_row, []).extend(hits)
    print(f"predictor: layer L+1's router on layer L's MLP input, {steps} steps, batch {batch}, "
          f"{len(recall[k])} (token, layer) pairs")
    for n, values in recall.items():
        print(f"  top-{n} predicted: recall of the {k} chosen {np.mean(values):.3f}")
    print("  by layer (top-k):", " ".join(f"{np.mean(per_layer[r]):.2f}" for r in sorted(per_layer)))


if __name__ == "__main__":
    main()
