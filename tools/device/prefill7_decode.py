"""On the GPU (issue 19 item 5): decode steps of many sequences with their experts as GEMVs (before)
and in tiles on tensor cores (moe_prefill.grouped_moe_placed), in one process over one model load:
per batch size and mode, the step's wall time (median of STEPS, the step's host work included, as
`bench decode` counts it; CUDA graphs), tok/s, and the modes' agreement: the eager step against its
graph bit for bit, and each mode's logprobs against the GEMVs' at the same positions.
Modes: gemv (MOEBUS_DECODE_GROUPED_PAIRS_PER_EXPERT=0), tiles (the default threshold), tiles+tc
(also the step's dense products, lm_head included, on tensor cores: TensorCores.min_rows 33).
Usage: prefill7_decode.py MODEL [BATCHES=32,64] [STEPS=16]"""
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
MODES = {"gemv": (0, None), "tiles": (moe_prefill.DECODE_PAIRS_PER_EXPERT or 8, None),
         "tiles+tc": (moe_prefill.DECODE_PAIRS_PER_EXPERT or 8, 33)}


def drop_graphs(model) -> None:
    for stage in model.stages:
        for graph in stage.graphs.values():
            graph.close()
        stage.graphs.clear()


def set_mode(model, mode: str, default_min_rows: int) -> None:
    pairs, min_rows = MODES[mode]
    moe_prefill.DECODE_PAIRS_PER_EXPERT = pairs
    model.backend.tensor_cores.min_rows = min_rows or default_min_rows
    drop_graphs(model)


def decode_step(batch: int, position: int, tokens) -> StepBatch:
    return StepBatch(slots=range(batch), starts=[position] * batch, lengths=[1] * batch, tokens=list(tokens))


def main() -> None:
    model_dir = sys.argv[1]
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "32,64").split(",")]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    model = LocalModel(model_dir, device="cuda", num_slots=max(batches), max_context=PROMPT + steps + 8,
                       kv_dtype="bf16", prefetch_slots=0)
    if SIMULATOR:  # a smoke test of this script on the CPU: HostBlas for cuBLAS, no graphs
        model.backend.tensor_cores = TensorCores(HostBlas())
    graphs = model.stages[0].use_graphs
    cfg, default_min_rows = model.ckpt.config, model.backend.tensor_cores.min_rows
    print(f"model {model_dir}: {cfg.num_layers} layers, {cfg.num_experts} experts, top {cfg.top_k}; steps {steps}")
    rows = []
    for batch in batches:
        prompt = [(7 * i + 3) % (cfg.vocab_size - 10) + 10 for i in range(PROMPT)]
        first = model.step(StepBatch(slots=range(batch), starts=[0] * batch, lengths=[PROMPT] * batch,
                                     tokens=prompt * batch)).tokens
        reference = None
        for mode in MODES:
            set_mode(model, mode, default_min_rows)
            for stage in model.stages:
                stage.use_graphs = False
            eager = model.step(decode_step(batch, PROMPT, first), want_logits=True)
            for stage in model.stages:
                stage.use_graphs = graphs
            graph = model.step(decode_step(batch, PROMPT, first), want_logits=True)  # captured
            replay = model.step(decode_step(batch, PROMPT, first), want_logits=True)
            same = bool(np.array_equal(eager.logits, graph.logits) and np.array_equal(graph.logits, replay.logits))
            z = graph.logits - graph.logits.max(1, keepdims=True)
            logprobs = z - np.log(np.exp(z).sum(1, keepdims=True))
            reference = logprobs if reference is None else reference
            last, times = graph.tokens, []
            for i in range(steps):
                start = time.perf_counter()
                out = model.step(decode_step(batch, PROMPT + 1 + i, last))
                times.append(time.perf_counter() - start)
                last = out.tokens
            ms = statistics.median(times) * 1e3
            row = dict(batch=batch, mode=mode, ms_per_step=round(ms, 2), tok_s=round(batch / ms * 1e3, 1),
                       graph_equals_eager=same, max_dlogprob_vs_gemv=float(np.abs(logprobs - reference).max()),
                       tokens_equal_gemv=bool(np.array_equal(logprobs.argmax(1), reference.argmax(1))))
            rows.append(row)
            print(row, flush=True)
    print(f"{'batch':>5} {'mode':>9} {'ms/step':>8} {'tok/s':>8} {'graph==eager':>12} {'|dlogprob| vs gemv':>18}")
    for r in rows:
        print(f"{r['batch']:>5} {r['mode']:>9} {r['ms_per_step']:>8} {r['tok_s']:>8} {r['graph_equals_eager']!s:>12} "
              f"{r['max_dlogprob_vs_gemv']:>18.2e}")


if __name__ == "__main__":
    main()
