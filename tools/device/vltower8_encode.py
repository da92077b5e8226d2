"""The Qwen3-VL-30B-A3B tower (random bf16 weights, where_time_goes.qwen3vl_tower) on one 1024 x 768
image (48 x 64 patches), on cuda (tools/device/vltower8.sh): the first encode, a new size's encode,
the warm encode as a graph (median of REPEATS) split into its host and GPU phases, then variants in
the same process, each re-captured and against the default's outputs (max |diff| / max |default|,
per output): the images' attention at split_scores / bf16 products (flash_attention.IMAGE_PRECISION)
and its build knobs (IMAGE_DEFINES: keys per tile, cp.async stages, blocks per SM), the tower's
products on bf16 inputs (qwen3vl_vision.GEMM_PRECISION), both, the host copies on one thread
(tower_graph.COPY_THREADS); the attention alone per variant (CUDA events); the GPU time by kernel
of the default and of the fastest variant (torch.profiler's CUPTI trace sees each graph node).

    vltower8_encode.py [REPEATS]"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vltower7_encode import REPEATS, _median_ms as median_ms, by_kernel  # noqa: E402
# label -> (attention precision, attention defines, tower GEMM precision, copy threads, attention warps a
# block); None: the default's
B2, B4 = ("MIN_BLOCKS", 2), ("MIN_BLOCKS", 4)
VARIANTS = {
    "attention split, 32 keys a tile (2 stages)": ("split", (("TILE_KEYS", 32),), None, None, None),
    "attention split_scores": ("split_scores", (), None, None, None),
    "attention split_scores, 32 keys a tile (2 stages)": ("split_scores", (("TILE_KEYS", 32),), None, None, None),
    "attention bf16 (2 stages)": ("bf16", (), None, None, None),
    "attention bf16, 1 stage": ("bf16", (("STAGES_WANTED", 1),), None, None, None),
    "attention bf16, 2 blocks an SM": ("bf16", (B2,), None, None, None),
    "attention bf16, 4 warps, 4 blocks an SM": ("bf16", (B4,), None, None, 4),
    "products bf16": (None, None, "bf16", None, None),
    "attention bf16 + products bf16": ("bf16", (), "bf16", None, None),
    "attention bf16 (2 blocks an SM) + products bf16": ("bf16", (B2,), "bf16", None, None),
    "host copies on 1 thread": (None, None, None, 1, None),
}


def relative(a, b) -> str:
    """max |a - b| / max |b| per output (embeds, DeepStack)."""
    return ", ".join(f"{float(np.abs(x - y).max() / np.abs(y).max()):.1e}" for x, y in zip(a, b))


class Settings:
    """The knobs a variant turns, put back by restore()."""

    def __init__(self):
        from moebus.cuda.kernels import flash_attention
        from moebus.workers import qwen3vl_vision, tower_graph

        self.places = {"precision": (flash_attention, "IMAGE_PRECISION"), "defines": (flash_attention, "IMAGE_DEFINES"),
                       "gemm": (qwen3vl_vision, "GEMM_PRECISION"), "threads": (tower_graph, "COPY_THREADS"),
                       "warps": (flash_attention, "IMAGE_WARPS")}
        self.default = {name: getattr(*place) for name, place in self.places.items()}

    def apply(self, values: tuple) -> None:
        for (name, place), value in zip(self.places.items(), values):
            setattr(*place, self.default[name] if value is None else value)

    def restore(self) -> None:
        self.apply((None,) * len(self.places))


def phases(model, image) -> None:
    """One warm replay's steps as TowerGraph.run takes them, each timed (median of REPEATS): the
    image's bytes in where it has them (the tower's default since vl11), else its patches."""
    from moebus.cuda.kernels.compat import cuda
    from moebus.workers.qwen3vl_grid import grid_tables
    from moebus.workers.tower_graph import pinned_out, upload
    from moebus.workers.tower_outputs import ReadyOutputs, embeds_and_deepstack

    model.encode_image(image)  # this image's graph: a new size's first encode is eager (vlcold10),
    model.capture_pending()  # captured here if not yet
    graph, stream = model.graph.graph, model.ops.stream
    rows = {"tables": [], "upload (host copies + H2D enqueued)": [], "graph + D2H (+ sync)": [], "GPU (events)": [],
            "collect (host copies)": []}
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        positions, indices, weights = grid_tables(image.grid_h, image.grid_w, model.cfg.merge_size, model.cfg.grid_side)
        pixels = {"pixels": image.pixels, "values": image.values} if getattr(image, "pixels", None) is not None \
            else {"patches": image.patches}
        inputs = {**pixels, "rope_pos": positions, "indices": indices, "weights": weights}
        t1 = time.perf_counter()
        upload(graph, inputs)
        if graph.flags is not None:
            graph.flags[:] = 0
        t2 = time.perf_counter()
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        graph.graph.launch(graph.stream)
        end.record(stream)
        out = pinned_out(graph)
        t3 = time.perf_counter()
        embeds_and_deepstack(out)
        if isinstance(out, ReadyOutputs):
            out.finish()
        t4 = time.perf_counter()
        for name, value in zip(rows, (t1 - t0, t2 - t1, t3 - t2, cuda.event_elapsed_time(start, end) / 1e3, t4 - t3)):
            rows[name].append(value)
    print(f"one warm replay by phase (median of {REPEATS}; {', '.join(pixels)} in):")
    for name, values in rows.items():
        print(f"  {name:<38} {statistics.median(values) * 1e3:7.2f} ms")


def attention_alone(label: str, settings: Settings, values: tuple, positions: int = 3072) -> float:
    """planes + fused attention of one block's shapes, GPU time by CUDA events over 5 calls."""
    from moebus.cuda.kernels.compat import cuda
    from moebus.cuda.kernels.vision_attention import image_attention_cuda

    ops = attention_alone.ops
    rng = np.random.default_rng(positions)
    q, k, v = (ops.weight(rng.standard_normal((positions, 16, 72), dtype=np.float32)) for _ in range(3))
    settings.apply(values)
    try:
        ops.begin_step()
        image_attention_cuda(ops, q, k, v, 1, 72 ** -0.5, ops.empty(q.shape))  # compiles, warms
        ops.synchronize()
        times = []
        for _ in range(3):
            ops.begin_step()
            outs = [ops.empty(q.shape) for _ in range(5)]
            start, end = cuda.event(), cuda.event()
            start.record(ops.stream)
            for out in outs:
                image_attention_cuda(ops, q, k, v, 1, 72 ** -0.5, out)
            end.record(ops.stream)
            end.synchronize()
            times.append(cuda.event_elapsed_time(start, end) / 5)
    finally:
        settings.restore()
    ms = min(times)
    print(f"  attention alone, {label}: {ms:.3f} ms, {4 * positions ** 2 * 16 * 72 / ms / 1e9:.1f} TFLOP/s useful")
    return ms


def main() -> None:
    from where_time_goes import qwen3vl_tower

    start = time.perf_counter()
    model, image = qwen3vl_tower()
    print(f"tower built in {time.perf_counter() - start:.1f} s: {model.cfg.depth} blocks, "
          f"{image.grid_h}x{image.grid_w} patches; graphs {model.graph.enabled}")
    encode = lambda: model.encode_image(image)  # noqa: E731 - its bytes in (vl11)
    start = time.perf_counter()
    first = encode()
    print(f"first encode (compiles, eager run): {(time.perf_counter() - start) * 1e3:.0f} ms")
    model.graph.close()
    start = time.perf_counter()
    encode()
    print(f"a new size's encode, kernels loaded (eager run): {(time.perf_counter() - start) * 1e3:.1f} ms; "
          f"its capture after the reply {(model.capture_pending() or 0) * 1e3:.1f} ms")
    graph_ms, base = median_ms(encode)
    print(f"warm encode as a graph, median of {REPEATS}: {graph_ms:.1f} ms (target <= 30); first == replayed: "
          f"{all(np.array_equal(a, b) for a, b in zip(first, base))}")
    phases(model, image)
    settings, results = Settings(), {}
    for label, values in VARIANTS.items():
        model.graph.close()
        settings.apply(values)
        try:
            start = time.perf_counter()
            encode()
            first_ms = (time.perf_counter() - start) * 1e3
            ms, out = median_ms(encode)
        finally:
            settings.restore()
            model.graph.close()
        results[label] = ms
        print(f"{label}: {ms:.1f} ms (first {first_ms:.0f} ms); max |diff| / max |default| {relative(out, base)}")
    model.graph.enabled = False
    eager_ms, eager = median_ms(encode, 3)
    model.graph.enabled = True
    print(f"eager, median of 3: {eager_ms:.1f} ms; graph == eager: {all(np.array_equal(a, b) for a, b in zip(base, eager))}")
    attention_alone.ops = model.ops
    print("image attention, 3072 patches, 16 heads, hd 72 (planes + fused, 5 back to back):")
    attention_alone("split (default)", settings, (None,) * 5)
    for label, values in VARIANTS.items():
        if values[0] is not None and values[2] is None:
            attention_alone(label, settings, values)
    print("GPU time by kernel, default:")
    by_kernel(encode)
    fastest = min(results, key=results.get)
    settings.apply(VARIANTS[fastest])
    model.graph.close()
    try:
        encode()
        print(f"GPU time by kernel, fastest variant ({fastest}):")
        by_kernel(encode)
    finally:
        settings.restore()
        model.graph.close()
    print(f"summary: default {graph_ms:.1f} ms; " + "; ".join(f"{k} {v:.1f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
