"""The Qwen3-VL-30B-A3B tower (random bf16 weights, where_time_goes.qwen3vl_tower) on one 1024 x 768
image (48 x 64 patches), on cuda: the first encode (a new size: eager run + capture), the warm encode
as a graph (median of REPEATS) and its variants in the same process — the fused attention's images at
the other of 4 and 8 warps a block, the products' inputs split by their own pass (split_rows) instead of by
LayerNorm / GELU (split_epilogues.py), q, k and v as three products, eager — each against the
default's outputs; the image
attention alone (CUDA events, 3072 and 729 patches, 4 and 8 warps); and the GPU time by kernel of the
replayed graph (torch.profiler's CUPTI trace sees each kernel node).

    vltower7_encode.py [REPEATS]"""
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 10


def _median_ms(run, repeats: int = REPEATS) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


def _diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _variant(label: str, model, encode, base, apply, undo) -> None:
    model.graph.close()
    apply()
    try:
        start = time.perf_counter()
        encode()
        first_ms = (time.perf_counter() - start) * 1e3
        ms, out = _median_ms(encode)
    finally:
        undo()
        model.graph.close()
    print(f"{label}: {ms:.1f} ms (first {first_ms:.0f} ms); max |diff| vs default {_diff(out, base):.1e}")


def attention_alone() -> None:
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.cuda.kernels import flash_attention
    from moebus.cuda.kernels.compat import cuda
    from moebus.cuda.kernels.vision_attention import image_attention_cuda

    ops, default = CudaBackend(), flash_attention.IMAGE_WARPS
    for positions in (3072, 729):
        rng = np.random.default_rng(positions)
        q, k, v = (ops.weight(rng.standard_normal((positions, 16, 72), dtype=np.float32)) for _ in range(3))
        outs = {}
        for warps in (4, 8):
            flash_attention.IMAGE_WARPS = warps
            times = []
            for i in range(6):
                ops.begin_step()
                start, end = cuda.event(), cuda.event()
                start.record(ops.stream)
                out = image_attention_cuda(ops, q, k, v, 1, 72 ** -0.5, ops.empty(q.shape))
                end.record(ops.stream)
                end.synchronize()
                times.append(cuda.event_elapsed_time(start, end))
            outs[warps] = ops.to_host(out)
            ms = statistics.median(times[1:])
            tflops = 4 * positions * positions * 16 * 72 / ms / 1e9
            print(f"image attention, {positions} patches, 16 heads, hd 72, {warps} warps: {ms:.3f} ms "
                  f"(planes + fused), {tflops:.1f} TFLOP/s useful")
        flash_attention.IMAGE_WARPS = default
        print(f"  4 vs 8 warps: max |diff| {float(np.abs(outs[4] - outs[8]).max()):.1e}")


def short_name(name: str) -> str:
    parts = re.findall(r"\d+([A-Za-z_][A-Za-z0-9_]*)", name)
    words = [p for p in parts if p not in ("cudapy", "moebus", "cuda", "kernels") and not p.startswith("_3c")]
    return ".".join(words[:2]) if name.startswith("_ZN") and words else name[:60]


def by_kernel(encode, runs: int = 5) -> None:
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("no torch: no GPU time by kernel")
        return
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                encode()
    except Exception as e:  # noqa: BLE001 - the other figures stand without it
        print(f"no GPU time by kernel: {type(e).__name__}: {e}")
        return
    rows = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            row = rows[short_name(e.name)]
            row[0] += 1
            row[1] += e.device_time_total
    total = sum(r[1] for r in rows.values()) / runs
    print(f"GPU time of one replayed encode: {total / 1e3:.2f} ms, by kernel:")
    print(f"{'kernel':<62} {'calls':>6} {'us/call':>8} {'ms':>7} {'share':>6}")
    for name, (calls, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:22]:
        print(f"{name:<62} {calls / runs:>6.0f} {us / calls:>8.1f} {us / runs / 1e3:>7.2f} {us / runs / total:>6.1%}")


def main() -> None:
    from where_time_goes import qwen3vl_tower

    from moebus.cuda.kernels import flash_attention
    from moebus.workers import qwen3vl_vision

    start = time.perf_counter()
    model, image = qwen3vl_tower()
    ops = model.ops
    print(f"tower built in {time.perf_counter() - start:.1f} s: {model.cfg.depth} blocks, "
          f"{image.grid_h}x{image.grid_w} patches; graphs {model.graph.enabled}")
    encode = lambda: model.encode(image.patches, image.grid_h, image.grid_w)  # noqa: E731
    start = time.perf_counter()
    first = encode()
    print(f"first encode (compiles, eager run + capture): {(time.perf_counter() - start) * 1e3:.0f} ms")
    start = time.perf_counter()
    model.graph.close()
    encode()
    print(f"a new size's encode, kernels loaded (eager run + capture): {(time.perf_counter() - start) * 1e3:.1f} ms")
    graph_ms, base = _median_ms(encode)
    print(f"warm encode as a graph, median of {REPEATS}: {graph_ms:.1f} ms (target <= 30); first == replayed: "
          f"{all(np.array_equal(a, b) for a, b in zip(first, base))}")
    by_kernel(encode)
    warps = flash_attention.IMAGE_WARPS
    _variant(f"images at {12 - warps} warps a block (default {warps})", model, encode, base,
             lambda: setattr(flash_attention, "IMAGE_WARPS", 12 - warps),
             lambda: setattr(flash_attention, "IMAGE_WARPS", warps))
    fused = (ops.layernorm_into, ops.bias_activation_into)

    def unfused():
        ops.layernorm_into = lambda x, w, b, eps, _: ops.layernorm(x, w, b, eps)
        ops.bias_activation_into = lambda y, b, name, _: ops.bias_activation(y, b, name)

    def refused():
        ops.layernorm_into, ops.bias_activation_into = fused

    _variant("inputs split by split_rows (no fused splits)", model, encode, base, unfused, refused)
    _variant("q, k, v as three products (not one strided-batched)", model, encode, base,
             lambda: setattr(qwen3vl_vision, "STACKED_QKV", False), lambda: setattr(qwen3vl_vision, "STACKED_QKV", True))
    model.graph.enabled = False
    eager_ms, eager = _median_ms(encode, 3)
    model.graph.enabled = True
    print(f"eager, median of 3: {eager_ms:.1f} ms; max |graph - eager| {_diff(base, eager):.1e}")
    attention_alone()


if __name__ == "__main__":
    main()
