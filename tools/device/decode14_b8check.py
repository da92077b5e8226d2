"""Batch 8's decode graphs with PDL against the same graphs without (fourteenth session: with the cuBLAS
workspace kept after every set_stream, batch 8's graphs should hold no alloc nodes, so PDL converts their
edges): one model (bf16 KV), greedy decode of BATCH sequences after a prompt, the graphs captured with
MOEBUS_PDL=0, then recaptured with the default (programmatic + trigger), then eager; tokens and logprobs
must be the same bits. Prints each run's graphs' edge counts (converted, refused, other nodes).
Usage: decode14_b8check.py MODEL_DIR [BATCH] [STEPS]"""
import os
import sys

import numpy as np

from decode7_bench import drop_graphs
from decode_tokens import decode_tokens
from moebus.workers.local import LocalModel

PROMPT = [5, 17, 99, 3, 42, 7, 250, 31, 8]


def edges(model) -> str:
    found = [g.pdl for s in model.stages for g in s.graphs.values() if getattr(g, "pdl", None)]
    other = {}
    for e in found:
        for kind, n in e.get("types", {}).items():
            other[kind.replace("CU_GRAPH_NODE_TYPE_", "")] = other.get(kind.replace("CU_GRAPH_NODE_TYPE_", ""), 0) + n
    refused = [e["refused"] for e in found if e.get("refused")]
    return (f"{len(found)} graphs, converted {[e['converted'] for e in found]} of {[e['edges'] for e in found]}, "
            f"other nodes {other}" + (f", refused {refused[:2]}" if refused else ""))


def main() -> None:
    model_dir = sys.argv[1]
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    model = LocalModel(model_dir, device="cuda", num_slots=batch, max_context=len(PROMPT) + steps + 8,
                       kv_dtype="bf16")
    runs = {}
    for name, pdl in (("graphs, PDL off", "0"), ("graphs, PDL default", None)):
        if pdl is None:
            os.environ.pop("MOEBUS_PDL", None)
        else:
            os.environ["MOEBUS_PDL"] = pdl
        drop_graphs(model)
        runs[name] = decode_tokens(model, PROMPT, batch, steps)
        print(f"b{batch} {name}: {runs[name][2] / steps * 1e3:.2f} ms a step (unwarmed); {edges(model)}", flush=True)
    for stage in model.stages:
        stage.use_graphs = False
    runs["eager"] = decode_tokens(model, PROMPT, batch, steps)
    base = runs["graphs, PDL off"]
    for name, (tokens, logprobs, _) in runs.items():
        same = np.array_equal(tokens, base[0]) and np.array_equal(logprobs, base[1])
        print(f"b{batch} {name} vs graphs, PDL off: {'same bits' if same else 'DIFFERENT'} "
              f"(tokens equal {np.array_equal(tokens, base[0])}, max |dlogprob| "
              f"{np.abs(logprobs - base[1]).max():.2e})", flush=True)


if __name__ == "__main__":
    main()
