"""On the GPU (issue 15's batch 8, issue 19 item 4), one process over one model load:

1. decode of a few sequences with the experts as GEMVs or in tiles on tensor cores
   (moe_prefill.DECODE_PAIRS_PER_EXPERT) and the dense products (q/k/v, o, lm_head) as GEMVs or on
   tensor cores (TensorCores.few_rows, gemm.linear_few): per batch and mode the step's wall time
   (median of STEPS, CUDA graphs, host work included as `bench decode` counts it), tok/s, graph ==
   eager, logprobs against the GEMVs'.
2. a step of 8 decode rows beside a prompt's chunk of C tokens at context P (routed, captured from its
   second step: Stage._graph_for): ms per step (median of 8 replays) against the decode step of 8,
   and the captured step against the eager one.
Usage: tc8_decode.py MODEL [BATCHES=1,4,8,16] [STEPS=16] [CHUNKS=16,32] [CONTEXTS=4096,8176]"""
import os
import statistics
import sys
import time

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR
from moebus.cuda.kernels.gemm import TensorCores
from moebus.cuda.kernels.gemm_host import HostBlas
from moebus.workers import moe_prefill
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel

PROMPT = 16
DECODE_ROWS = 8
MODES = {"gemv": (0, 0), "tiles": (2, 0), "gemv+tc": (0, 2), "tiles+tc": (2, 2)}  # (pairs per expert, few_rows)


def drop_graphs(model) -> None:
    for stage in model.stages:
        for graph in stage.graphs.values():
            graph.close()
        stage.graphs.clear()
        stage.mixed_shapes.clear()


def set_mode(model, mode: str) -> None:
    moe_prefill.DECODE_PAIRS_PER_EXPERT, model.backend.tensor_cores.few_rows = MODES[mode]
    drop_graphs(model)


def logprobs_of(logits):
    z = logits - logits.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def decode_step(batch: int, position: int, tokens) -> StepBatch:
    return StepBatch(slots=range(batch), starts=[position] * batch, lengths=[1] * batch, tokens=list(tokens))


def eager_and_graph(model, step: StepBatch):
    """The step eagerly, then 3 times with graphs (a mixed step: eager, captured, replayed; decode:
    captured, replayed twice): the eager result and the last two."""
    stages = model.stages
    graphs = [s.use_graphs for s in stages]
    for s in stages:
        s.use_graphs = False
    eager = model.step(step, want_logits=True)
    for s, g in zip(stages, graphs):
        s.use_graphs = g
    runs = [model.step(step, want_logits=True) for _ in range(3)]
    return eager, runs[-2], runs[-1]


def decode_modes(model, batches: list[int], steps: int) -> list[dict]:
    vocab, rows = model.ckpt.config.vocab_size, []
    for batch in batches:
        prompt = [(7 * i + 3) % (vocab - 10) + 10 for i in range(PROMPT)]
        first = model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[PROMPT] * batch,
                                     tokens=prompt * batch)).tokens
        reference = None
        for mode in (MODES if batch > 1 else ["gemv"]):
            set_mode(model, mode)
            eager, graph, replay = eager_and_graph(model, decode_step(batch, PROMPT, first))  # (captured on the 2nd)
            same = bool(np.array_equal(eager.logits, graph.logits) and np.array_equal(graph.logits, replay.logits))
            logprobs = logprobs_of(graph.logits)
            reference = logprobs if reference is None else reference
            last, times = graph.tokens, []
            for i in range(steps):
                start = time.perf_counter()
                last = model.step(decode_step(batch, PROMPT + 1 + i, last)).tokens
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3
            row = dict(batch=batch, mode=mode, ms_per_step=round(ms, 3), tok_s=round(batch / ms * 1e3, 1),
                       graph_equals_eager=same, max_dlogprob_vs_gemv=float(np.abs(logprobs - reference).max()),
                       tokens_equal_gemv=bool(np.array_equal(logprobs.argmax(1), reference.argmax(1))))
            rows.append(row)
            print(row, flush=True)
    return rows


def mixed_steps(model, chunks: list[int], contexts: list[int]) -> list[dict]:
    """8 decode rows (slots 0-7, short contexts) + a chunk of C tokens of slot 8 at positions P ...
    (positions before P hold whatever the cache holds: attention reads them all the same)."""
    set_mode(model, "tiles+tc")  # then the defaults (or the environment's)
    moe_prefill.DECODE_PAIRS_PER_EXPERT = int(os.environ.get("MOEBUS_DECODE_GROUPED_PAIRS_PER_EXPERT", "2"))
    model.backend.tensor_cores.few_rows = int(os.environ.get("MOEBUS_GEMM_FEW_ROWS", "8"))
    last, rows = [11] * DECODE_ROWS, []
    decode_ms = None
    for chunk in [0] + chunks:
        for context in (contexts if chunk else [0]):
            def step(i):
                return StepBatch(slots=list(range(DECODE_ROWS)) + ([DECODE_ROWS] if chunk else []),
                                 starts=[PROMPT + i] * DECODE_ROWS + ([context] if chunk else []),
                                 lengths=[1] * DECODE_ROWS + ([chunk] if chunk else []),
                                 tokens=last + [(13 * j + 5) % 200 + 10 for j in range(chunk)])
            eager, graph, replay = eager_and_graph(model, step(0))  # mixed: eager (1st), capture (2nd)
            same = bool(np.array_equal(eager.logits, graph.logits, equal_nan=True)
                        and np.array_equal(graph.logits, replay.logits, equal_nan=True))
            times = []
            for i in range(8):
                start = time.perf_counter()
                model.step(step(1 + i))
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3
            decode_ms = decode_ms or ms
            row = dict(chunk=chunk, context=context, ms_per_step=round(ms, 3), vs_decode=round(ms / decode_ms, 3),
                       graph_equals_eager=same, captures=model.stages[0].graph_captures)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    model_dir = sys.argv[1]
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,4,8,16").split(",")]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    chunks = [int(c) for c in (sys.argv[4] if len(sys.argv) > 4 else "16,32").split(",") if c]
    contexts = [int(c) for c in (sys.argv[5] if len(sys.argv) > 5 else "4096,8176").split(",")]
    max_context = max(contexts) + max(chunks, default=0) + 16 if chunks else PROMPT + steps + 8
    model = LocalModel(model_dir, device="cuda", num_slots=max(max(batches), DECODE_ROWS + 1),
                       max_context=max_context, kv_dtype="bf16", prefetch_slots=0)
    if SIMULATOR:  # a smoke test of this script on the CPU: HostBlas for cuBLAS, no graphs
        model.backend.tensor_cores = TensorCores(HostBlas())
    cfg = model.ckpt.config
    print(f"model {model_dir}: {cfg.num_layers} layers, {cfg.num_experts} experts, top {cfg.top_k}; steps {steps}; "
          f"max_context {max_context}", flush=True)
    rows = decode_modes(model, batches, steps)
    print(f"{'batch':>5} {'mode':>9} {'ms/step':>8} {'tok/s':>8} {'graph==eager':>12} {'|dlp| vs gemv':>14} "
          f"{'tokens==gemv':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['mode']:>9} {r['ms_per_step']:>8} {r['tok_s']:>8} {r['graph_equals_eager']!s:>12} "
              f"{r['max_dlogprob_vs_gemv']:>14.2e} {r['tokens_equal_gemv']!s:>12}", flush=True)
    if chunks:
        mixed = mixed_steps(model, chunks, contexts)
        print(f"{'chunk':>5} {'context':>7} {'ms/step':>8} {'x decode':>8} {'graph==eager':>12}")
        for r in mixed:
            print(f"{r['chunk']:>5} {r['context']:>7} {r['ms_per_step']:>8} {r['vs_decode']:>8} "
                  f"{r['graph_equals_eager']!s:>12}")


if __name__ == "__main__":
    main()
