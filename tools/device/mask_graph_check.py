"""On the GPU: structured outputs' masks in the decode step. Batch 8, row 0 under an allowed-token
bitmask that changes every step (rows 1-7 free), eager vs CUDA graphs: the same tokens and logprobs;
row 0 always inside its mask; rows 1-7 as in a batch without any mask; and batches with and without
a masked row alternating (each has its captured graph: neither is recaptured). Usage:
mask_graph_check.py MODEL_DIR [TOKENS]"""
import os
import sys

import numpy as np

from moebus.cuda.kernels.sampling import allowed_ids, mask_words
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

model_dir = sys.argv[1]
prompt = [5, 17, 99, 3, 42, 7, 250, 31, 8]
BATCH, TOKENS = 8, int(sys.argv[2]) if len(sys.argv) > 2 else 24


def masks(vocab: int, steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [np.packbits(np.pad(rng.random(vocab) < 0.05, (0, mask_words(vocab) * 32 - vocab)),
                        bitorder="little").view(np.uint32)[None] for _ in range(steps)]


def run(graphs: bool, masked_steps):
    os.environ["MOEBUS_CUDA_GRAPHS"] = "1" if graphs else "0"
    model = LocalModel(model_dir, device="cuda", num_slots=BATCH, max_context=64)
    vocab = model.ckpt.config.vocab_size
    model.step(StepBatch(slots=range(BATCH), starts=[0] * BATCH, lengths=[len(prompt)] * BATCH, tokens=prompt * BATCH))
    out_tokens, out_lp, last, step_masks = [], [], [prompt[-1] + s for s in range(BATCH)], masks(vocab, TOKENS)
    for i in range(TOKENS):
        extra = {"mask": step_masks[i], "mask_rows": [0] + [-1] * (BATCH - 1)} if i in masked_steps else {}
        out = model.step(StepBatch(slots=range(BATCH), starts=[len(prompt) + i] * BATCH, lengths=[1] * BATCH,
                                   tokens=last, temperature=[0.8] * BATCH, u=np.linspace(0.05, 0.95, BATCH), **extra))
        last = [int(x) for x in out.tokens]
        out_tokens.append(last)
        out_lp.append(out.logprobs.copy())
        if i in masked_steps:
            assert allowed_ids(step_masks[i][0], vocab)[last[0]], f"step {i}: row 0 left its mask"
    graphs_held = sorted(model.stages[-1].graphs) if graphs else []
    del model
    return np.array(out_tokens), np.array(out_lp), graphs_held


ok = True
every, alternate = set(range(TOKENS)), set(range(0, TOKENS, 2))
for name, steps in (("every step masked", every), ("masked and plain alternating", alternate)):
    eager, graph = run(False, steps), run(True, steps)
    same, dlp = np.array_equal(eager[0], graph[0]), float(np.abs(eager[1] - graph[1]).max())
    ok &= same and dlp < 1e-5
    print(f"{name}: graph vs eager same tokens {same}, max |dlogprob| {dlp:.2e}, graphs held {graph[2]}")
plain = run(True, set())
first_free = np.array_equal(plain[0][:1, 1:], run(True, every)[0][:1, 1:])  # before the trajectories part
ok &= first_free
print(f"rows 1-7 of the first masked step as without a mask: {first_free}")
print("MASK GRAPH CHECK", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
