"""On the GPU, one process: greedy decode on a model (graphs, steps launched ahead: decode_tokens_ahead) with
each setting of kernel constants in turn (decode13_bench's "module.NAME=VALUE", each setting applied on top of
the ones before, the graphs recaptured between settings), at batch 1 and 4 from a 32-token prompt over STEPS (env, 160) steps, so the tensor-core decode
attention meets 1, 2 and 3 splits of 64 positions; each setting's tokens and logprobs against the first's (bit
for bit, or the largest difference) and the graphs' PDL counts. Also compiles every kernel the settings' decode
steps use (decode16.sh's warm phase).

    decode16_check.py MODEL_DIR SETTING...    SETTING: "name:KEY=VALUE,KEY=VALUE" ("tc:" the defaults)"""
import os
import sys

import numpy as np

from decode7_bench import PROMPT, drop_graphs
from decode13_bench import apply
from decode_tokens import decode_tokens_ahead
from moebus.workers.local import LocalModel

STEPS = int(os.environ.get("STEPS", "160"))
DEVICE = os.environ.get("DEVICE", "cuda")  # cpu: the script's own check, anywhere
BATCHES = (1, 4)


def main() -> None:
    model_dir, settings = sys.argv[1], sys.argv[2:]
    model = LocalModel(model_dir, device=DEVICE, num_slots=max(BATCHES), max_context=len(PROMPT) + STEPS + 8,
                       kv_dtype="bf16" if DEVICE == "cuda" else "fp32")
    first = {}
    for setting in settings:
        name, _, items = setting.partition(":")
        apply(items.replace(",", " ").split())
        drop_graphs(model)
        cells = []
        for batch in BATCHES:
            tokens, logprobs, _ = decode_tokens_ahead(model, PROMPT, batch, STEPS)
            if batch not in first:
                first[batch] = tokens, logprobs
                cells.append(f"b{batch} first")
                continue
            same_tokens = np.array_equal(tokens, first[batch][0])
            same_bits = same_tokens and np.array_equal(logprobs.view(np.uint32), first[batch][1].view(np.uint32))
            cells.append(f"b{batch} " + ("same bits" if same_bits else f"tokens {'same' if same_tokens else 'DIFFER'}"
                                         f", logprob max diff {np.max(np.abs(logprobs - first[batch][1])):.2e}"))
        print(f"check {name:<8} " + ", ".join(cells) + f"  [{items or 'defaults'}]" + _pdl_counts(model), flush=True)


def _pdl_counts(model) -> str:
    """The captured graphs' PDL counts (pdl.make_programmatic): waiting kernel nodes / kernel nodes, edges made
    programmatic (TC_PDL: the tensor-core attention's nodes among the waiting)."""
    counts = [g.pdl for stage in model.stages for g in stage.graphs.values() if getattr(g, "pdl", None)]
    if not counts:
        return ""
    total = {key: sum(c.get(key, 0) for c in counts) for key in ("waiting", "kernels", "converted")}
    refused = sum("refused" in c for c in counts)
    return f"  pdl waiting {total['waiting']}/{total['kernels']} converted {total['converted']}" + \
        (f" refused {refused}" if refused else "")


if __name__ == "__main__":
    main()
