"""On the GPU (issue 19 item 4, tenth session): one layer's attention of a routed step of 8 decode
rows (position 24) + a prompt's chunk of C rows of a 9th sequence at positions P..P+C-1, A3B's shapes
(32 query heads, 4 kv heads, hd 128, bf16 KV cache), on three kernels: the decode kernel
(attention.attention_cuda: a block per row), the numba tile kernel and the tensor-core tile kernel
(attention_chunk.attention_tiles_cuda, kernel "numba" / "tc"). Each is CAPTURED: REPEATS calls in one
CUDA graph (cuda.core GraphBuilder, as a step's capture), the graph launched between two CUDA events,
so the figure is GPU time per call with no host launches in it (the ninth session's 2.1-2.6x for the
numba tile kernel was eager, events around Python launches). Median of 5 graph launches. Also the
largest |difference| of each tile kernel's output from the decode kernel's.
Usage: beside10_attention.py [CHUNKS=0,8,16,32,56] [CONTEXTS=4096,8176] [REPEATS=20] [SPLIT_KEYS=256,128]"""
import statistics
import sys

import numpy as np

from moebus.cuda.backends.graphs import _core_stream
from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels import attention_chunk_tc
from moebus.cuda.kernels.attention import attention_cuda, attention_scratch_shape
from moebus.cuda.kernels.attention_chunk import attention_tiles_cuda, chunk_tiles, tile_rows
from moebus.cuda.kernels.compat import cuda

HEADS, KV_HEADS, HEAD_DIM, DECODE_ROWS, DECODE_POS = 32, 4, 128, 8, 24


def graph_us(call, repeats: int) -> float:
    """GPU us per call: ``repeats`` calls captured in one graph, median of 5 launches."""
    stream = cuda.stream()
    call(stream)  # compiled and warm, eagerly
    stream.synchronize()
    core = _core_stream(stream)
    builder = core.create_graph_builder()
    try:
        builder = builder.begin_building("relaxed")
    except TypeError:
        builder = builder.begin_building()
    for _ in range(repeats):
        call(builder)
    graph = builder.end_building().complete()
    start, stop, times = cuda.event(), cuda.event(), []
    graph.launch(core)
    stream.synchronize()
    for _ in range(5):
        start.record(stream)
        graph.launch(core)
        stop.record(stream)
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / repeats)
    graph.close()
    return statistics.median(times)


def main() -> None:
    chunks = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "0,8,16,32,56").split(",")]
    contexts = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "4096,8176").split(",")]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    split_keys = [int(c) for c in (sys.argv[4] if len(sys.argv) > 4 else "256,128").split(",")]
    context = max(contexts) + max(chunks) + 16
    rng = np.random.default_rng(0)
    cache_shape = (DECODE_ROWS + 1, KV_HEADS, context, HEAD_DIM)
    k_cache = cuda.to_device(f32_to_bf16(rng.standard_normal(cache_shape, dtype=np.float32)))
    v_cache = cuda.to_device(f32_to_bf16(rng.standard_normal(cache_shape, dtype=np.float32)))
    scale = HEAD_DIM ** -0.5
    group = HEADS // KV_HEADS
    print(f"A3B attention, bf16 KV, max_context {context}; GPU us per layer, {repeats} calls in one graph, "
          f"median of 5; tc splits of >= {split_keys} keys", flush=True)
    names = ["decode", "numba"] + [f"tc{k}" for k in split_keys]
    print(f"{'chunk':>5} {'P':>5} " + " ".join(f"{n:>9}" for n in names) + "  max|diff| numba, tc")
    for chunk in chunks:
        for position in (contexts if chunk else [0]):
            lengths = [1] * DECODE_ROWS + ([chunk] if chunk else [])
            slots = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
            pos = np.concatenate([np.full(DECODE_ROWS, DECODE_POS, np.int32),
                                  np.arange(position, position + chunk, dtype=np.int32)])
            firsts = np.cumsum([0] + lengths)[:-1]
            segments = [(int(f), s, int(p), n) for f, s, p, n in zip(firsts, range(len(lengths)), pos[firsts], lengths)]
            q = cuda.to_device(rng.standard_normal((len(pos), HEADS, HEAD_DIM), dtype=np.float32))
            d_slots, d_pos = cuda.to_device(slots), cuda.to_device(pos)
            scratch = cuda.device_array(attention_scratch_shape(len(pos), HEADS, HEAD_DIM, context), np.float32)
            decode_pos = cuda.device_array(len(pos), np.int32)
            outs = {n: cuda.device_array((len(pos), HEADS, HEAD_DIM), np.float32) for n in names}
            us = {"decode": graph_us(lambda s: attention_cuda(q, k_cache, v_cache, d_slots, d_pos, scale, 0,
                                                              outs["decode"], scratch, stream=s), repeats)}
            for name in names[1:]:
                kernel = "numba" if name == "numba" else "tc"
                tiles = cuda.to_device(chunk_tiles(segments, len(pos), tile_rows(kernel, group, HEAD_DIM)))
                if kernel == "tc":
                    attention_chunk_tc.SPLIT_KEYS = int(name[2:])
                us[name] = graph_us(lambda s: attention_tiles_cuda(q, k_cache, v_cache, tiles, d_slots, d_pos, scale,
                                                                   outs[name], scratch, decode_pos, stream=s,
                                                                   kernel=kernel), repeats)
            want = outs["decode"].copy_to_host()
            diffs = [float(np.abs(outs[n].copy_to_host() - want).max()) for n in names[1:]]
            print(f"{chunk:>5} {position:>5} " + " ".join(f"{us[n]:>9.1f}" for n in names) + "  " +
                  " ".join(f"{d:.1e}" for d in diffs), flush=True)


if __name__ == "__main__":
    main()
