"""On the GPU (issue 19 item 4): one layer's attention of a routed step of 8 decode rows (short
contexts) + a prompt's chunk of C rows of a 9th sequence at positions P..P+C-1, A3B's shapes (32 query
heads, 4 kv heads, hd 128, bf16 KV cache), on the decode kernel (attention.attention_cuda: a block per
row) and on the tile kernel (attention_chunk.attention_tiles_cuda: a tile's rows share their keys'
reads): us per launch pair (kernel + merge; median of REPEATS, CUDA events, one stream), and the
largest |difference| of the two outputs (they sum in different orders).
Usage: chunk8_attention.py [CHUNKS=0,8,16,32] [CONTEXTS=4096,8176] [REPEATS=50]"""
import statistics
import sys

import numpy as np

from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels.attention import attention_cuda, attention_scratch_shape
from moebus.cuda.kernels.attention_chunk import attention_tiles_cuda, chunk_tiles, rows_per_tile
from moebus.cuda.kernels.compat import cuda

HEADS, KV_HEADS, HEAD_DIM, DECODE_ROWS, DECODE_POS = 32, 4, 128, 8, 24


def timed_us(launch, repeats: int) -> float:
    start, stop, times = cuda.event(), cuda.event(), []
    launch()  # compiled and warm
    for _ in range(repeats):
        start.record()
        launch()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def main() -> None:
    chunks = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "0,8,16,32").split(",")]
    contexts = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "4096,8176").split(",")]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 50
    context = max(contexts) + max(chunks) + 16
    rng = np.random.default_rng(0)
    cache_shape = (DECODE_ROWS + 1, KV_HEADS, context, HEAD_DIM)
    k_cache = cuda.to_device(f32_to_bf16(rng.standard_normal(cache_shape, dtype=np.float32)))
    v_cache = cuda.to_device(f32_to_bf16(rng.standard_normal(cache_shape, dtype=np.float32)))
    rows = rows_per_tile(HEADS // KV_HEADS, HEAD_DIM)
    print(f"A3B attention, bf16 KV, max_context {context}, {rows} rows a tile; us per layer (median of {repeats})")
    print(f"{'chunk':>5} {'P':>5} {'decode kernel':>13} {'tile kernel':>11} {'x faster':>8} {'max |diff|':>10}")
    for chunk in chunks:
        for position in (contexts if chunk else [0]):
            lengths = [1] * DECODE_ROWS + ([chunk] if chunk else [])
            slots = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
            pos = np.concatenate([np.full(DECODE_ROWS, DECODE_POS, np.int32),
                                  np.arange(position, position + chunk, dtype=np.int32)])
            firsts = np.cumsum([0] + lengths)[:-1]
            segments = [(int(f), s, int(p), n) for f, s, p, n in zip(firsts, range(len(lengths)), pos[firsts], lengths)]
            tiles = cuda.to_device(chunk_tiles(segments, len(pos), rows))
            q = cuda.to_device(rng.standard_normal((len(pos), HEADS, HEAD_DIM), dtype=np.float32))
            d_slots, d_pos = cuda.to_device(slots), cuda.to_device(pos)
            scratch = cuda.device_array(attention_scratch_shape(len(pos), HEADS, HEAD_DIM, context), np.float32)
            out_decode = cuda.device_array((len(pos), HEADS, HEAD_DIM), np.float32)
            out_tiles = cuda.device_array((len(pos), HEADS, HEAD_DIM), np.float32)
            decode_us = timed_us(lambda: attention_cuda(q, k_cache, v_cache, d_slots, d_pos, HEAD_DIM ** -0.5, 0,
                                                        out_decode, scratch), repeats)
            tiles_us = timed_us(lambda: attention_tiles_cuda(q, k_cache, v_cache, tiles, d_slots, d_pos,
                                                             HEAD_DIM ** -0.5, out_tiles, scratch), repeats)
            diff = float(np.abs(out_decode.copy_to_host() - out_tiles.copy_to_host()).max())
            print(f"{chunk:>5} {position:>5} {decode_us:>13.1f} {tiles_us:>11.1f} {decode_us / tiles_us:>8.2f} "
                  f"{diff:>10.2e}", flush=True)


if __name__ == "__main__":
    main()
