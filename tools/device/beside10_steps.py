"""On the GPU (issue 19 item 4, tenth session), one process over one model load: a routed step of 8
decode rows (slots 0-7, short contexts) + a prompt's chunk of C tokens of a 9th sequence at
positions P.. (tc8_decode.mixed_steps' steps), captured from its second step (Stage._graph_for), ms
per step (median of 8 replays with the host's work) against the decode step of 8, with the chunk's
attention on
  decode  the decode kernel (a block per row; MOEBUS_CHUNK_ATTENTION=0, the default),
  numba   attention_chunk's numba tile kernel (=1),
  tc      attention_chunk_tc's tensor-core kernel (=tc),
switched at run time (the stages' tile_kernel / tile_rows, graphs dropped). Per row: captured ==
eager bit for bit, and the eager step's logits against the decode kernel's (max |dlogit|, greedy
tokens equal; each context's chunk has its own KV slot, so the cells of every mode see the same keys:
the tenth session's call shared one slot, and a chunk at 8176 saw what the previous sweep's chunks
had written at 4096.., which made its |dlogit| against the decode kernel's 1.2-1.5 where the keys
were equal 4e-4).
Usage: beside10_steps.py MODEL [CHUNKS=8,16,32,56] [CONTEXTS=4096,8176] [MODES=decode,tc,numba]
  [NUMBA_CELLS=16:8176,32:8176 (the numba mode's cells; all: every one)]"""
import statistics
import sys
import time

import numpy as np

from tc8_decode import DECODE_ROWS, PROMPT, drop_graphs, eager_and_graph

from moebus.cuda.kernels import attention_chunk_tc
from moebus.cuda.kernels.attention_chunk import tile_rows
from moebus.workers.batch import StepBatch
from moebus.workers.local import LocalModel


def set_mode(model, mode: str) -> None:
    cfg = model.ckpt.config
    group = cfg.num_heads // cfg.num_kv_heads
    kernel = "numba" if mode != "tc" else "tc"
    if mode == "tc" and not attention_chunk_tc.ready(cfg.head_dim, group, "bf16"):
        raise RuntimeError("the tensor-core chunk attention did not build")
    rows = 0 if mode == "decode" else tile_rows(kernel, group, cfg.head_dim)
    for stage in model.stages:
        stage.tile_kernel, stage.tile_rows = kernel, rows
    drop_graphs(model)


def one_cell(model, chunk: int, context: int, slot: int) -> dict:
    """``slot``: the chunk's sequence, one per context (a chunk at 8k must not see what a chunk at 4k
    of another mode's sweep left in its cache: every mode's cell then sees the same keys)."""
    last = [11] * DECODE_ROWS

    def step(i):
        return StepBatch(slots=list(range(DECODE_ROWS)) + ([slot] if chunk else []),
                         starts=[PROMPT + i] * DECODE_ROWS + ([context] if chunk else []),
                         lengths=[1] * DECODE_ROWS + ([chunk] if chunk else []),
                         tokens=last + [(13 * j + 5) % 200 + 10 for j in range(chunk)])
    eager, graph, replay = eager_and_graph(model, step(0))
    same = bool(np.array_equal(eager.logits, graph.logits, equal_nan=True)
                and np.array_equal(graph.logits, replay.logits, equal_nan=True))
    times = []
    for i in range(8):
        start = time.perf_counter()
        model.step(step(1 + i))
        times.append(time.perf_counter() - start)
    return dict(ms=statistics.median(times) * 1e3, graph_equals_eager=same, logits=eager.logits)


def main() -> None:
    model_dir = sys.argv[1]
    chunks = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "8,16,32,56").split(",")]
    contexts = [int(c) for c in (sys.argv[3] if len(sys.argv) > 3 else "4096,8176").split(",")]
    modes = (sys.argv[4] if len(sys.argv) > 4 else "decode,tc,numba").split(",")
    numba_cells = sys.argv[5] if len(sys.argv) > 5 else "16:8176,32:8176"
    max_context = max(contexts) + max(chunks) + 16
    model = LocalModel(model_dir, device="cuda", num_slots=DECODE_ROWS + len(contexts), max_context=max_context,
                       kv_dtype="bf16", prefetch_slots=0)
    cfg = model.ckpt.config
    print(f"model {model_dir}: {cfg.num_layers} layers, {cfg.num_experts} experts; max_context {max_context}; "
          f"tc splits of >= {attention_chunk_tc.SPLIT_KEYS} keys", flush=True)
    reference, rows = {}, []
    for mode in modes:
        set_mode(model, mode)
        base = None
        cells = [(0, 0)] + [(c, p) for c in chunks for p in contexts]
        if mode == "numba" and numba_cells != "all":
            cells = [(0, 0)] + [tuple(int(v) for v in cell.split(":")) for cell in numba_cells.split(",")]
        for chunk, context in cells:
            r = one_cell(model, chunk, context, DECODE_ROWS + (contexts.index(context) if chunk else 0))
            base = base or r["ms"]
            ref = reference.setdefault((chunk, context), r["logits"])
            row = dict(mode=mode, chunk=chunk, context=context, ms=round(r["ms"], 3),
                       x_decode8=round(r["ms"] / base, 3), graph_equals_eager=r["graph_equals_eager"],
                       max_dlogit_vs_decode=float(np.abs(r["logits"] - ref).max()),
                       tokens_equal=bool(np.array_equal(r["logits"].argmax(1), ref.argmax(1))))
            rows.append(row)
            print(row, flush=True)
    print(f"{'mode':>6} {'chunk':>5} {'P':>5} {'ms/step':>8} {'x dec8':>7} {'graph==eager':>12} {'|dlogit|':>9} "
          f"{'tokens==':>8}")
    for r in rows:
        print(f"{r['mode']:>6} {r['chunk']:>5} {r['context']:>5} {r['ms']:>8.2f} {r['x_decode8']:>7.3f} "
              f"{r['graph_equals_eager']!s:>12} {r['max_dlogit_vs_decode']:>9.2e} {r['tokens_equal']!s:>8}", flush=True)


if __name__ == "__main__":
    main()
