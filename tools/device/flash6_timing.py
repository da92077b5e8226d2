"""GPU time of attention alone, the fused kernel (flash_attention.py) against the materialised path
(cuBLAS products + masked softmax, prefill_attention.py with the kernel turned off), on the shapes
that matter: A3B prefill (32 query heads, 4 kv heads, hd 128, bf16 KV cache) of one T-token prompt,
and the towers' image attention (16 heads, hd 72, float32): so400m (729 patches) and Qwen3-VL at
1024 x 768 (3072 patches). Each: median of REPEATS by CUDA events after a warm-up (which compiles),
the effective TFLOP/s (4 L n H hd / 2 causal), and the largest difference between the two outputs.
Also a graph check: the fused kernel launched into a cuda.core GraphBuilder, replayed, equals eager.

    flash6_timing.py [REPEATS]"""
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moebus.cuda.backends.cuda import CudaBackend  # noqa: E402
from moebus.cuda.dtypes import f32_to_bf16  # noqa: E402
from moebus.cuda.kernels import flash_attention, prefill_attention  # noqa: E402
from moebus.cuda.kernels.compat import cuda  # noqa: E402

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 5


def _gpu_ms(ops, run) -> tuple[float, object]:
    run()  # warm-up: compiles, loads
    ops.stream.synchronize()
    times = []
    for _ in range(REPEATS):
        ops.begin_step()
        start, end = cuda.event(), cuda.event()
        start.record(ops.stream)
        out = run()
        end.record(ops.stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times), ops.to_host(out)


def _both(ops, run) -> dict:
    flash_attention.ENABLED = False
    old_ms, old = _gpu_ms(ops, run)
    flash_attention.ENABLED = True
    new_ms, new = _gpu_ms(ops, run)
    return {"old_ms": old_ms, "flash_ms": new_ms, "diff": float(np.abs(new - old).max()), "out": new}


def prefill(ops, tokens: int, heads: int = 32, kv_heads: int = 4, head_dim: int = 128) -> dict:
    rng = np.random.default_rng(tokens)
    q = ops.weight(rng.standard_normal((tokens, heads, head_dim), dtype=np.float32))
    k, v = (ops.weight(f32_to_bf16(rng.standard_normal((1, kv_heads, tokens, head_dim), dtype=np.float32)))
            for _ in range(2))
    scale = head_dim ** -0.5
    row = _both(ops, lambda: prefill_attention.prefill_attention(ops, ops.tensor_cores, q, k, v, [(0, 0, 0, tokens)],
                                                                 scale, 0, ops.empty(q.shape)))
    row["tflops"] = 4 * tokens * tokens / 2 * heads * head_dim / row["flash_ms"] / 1e9
    return row


def images(ops, positions: int, heads: int = 16, head_dim: int = 72) -> dict:
    rng = np.random.default_rng(positions)
    q, k, v = (ops.weight(rng.standard_normal((positions, heads, head_dim), dtype=np.float32)) for _ in range(3))
    scale = head_dim ** -0.5
    row = _both(ops, lambda: prefill_attention.image_attention(ops, ops.tensor_cores, q, k, v, 1, scale,
                                                               ops.empty(q.shape)))
    row["tflops"] = 4 * positions * positions * heads * head_dim / row["flash_ms"] / 1e9
    return row


def graph_equals_eager(ops) -> bool:
    from moebus.cuda.backends.graphs import _core_stream

    rng = np.random.default_rng(7)
    q, k, v = (ops.weight(rng.standard_normal((300, 4, 64), dtype=np.float32)) for _ in range(3))
    eager = ops.to_host(flash_attention.flash_images_cuda(q, k, v, 2, 0.125, ops.empty(q.shape), ops.stream))
    out = cuda.device_array(q.shape, np.float32)
    stream = _core_stream(ops.stream)
    builder = stream.create_graph_builder().begin_building()
    flash_attention.flash_images_cuda(q, k, v, 2, 0.125, out, builder)
    graph = builder.end_building().complete()
    graph.launch(stream)
    return bool(np.array_equal(ops.to_host(out), eager))


def main() -> None:
    ops = CudaBackend()
    print(f"graph replay == eager: {graph_equals_eager(ops)}")
    print(f"{'case':34s} {'materialised ms':>16s} {'flash ms':>9s} {'speed-up':>8s} {'TFLOP/s':>8s} {'max|diff|':>10s}")
    cases = [(f"prefill T={t} (32/4 heads, hd 128)", lambda t=t: prefill(ops, t)) for t in (512, 2048, 8192)]
    cases += [("so400m image, 729 patches", lambda: images(ops, 729)),
              ("Qwen3-VL 1024x768, 3072 patches", lambda: images(ops, 3072))]
    for label, run in cases:
        r = run()
        print(f"{label:34s} {r['old_ms']:16.3f} {r['flash_ms']:9.3f} {r['old_ms'] / r['flash_ms']:8.1f} "
              f"{r['tflops']:8.1f} {r['diff']:10.2e}", flush=True)


if __name__ == "__main__":
    main()
