"""Warm encode of one image by each vision tower on cuda, captured as a CUDA graph (the default) and
eager, in one process: the first encode (compiles or loads kernels, captures), the median of 10 warm
encodes each way, and how far apart the two outputs are.
Usage: tower_encode.py LLAVA_MODEL_DIR (SigLIP-so400m's tower there; the Qwen3-VL-30B-A3B tower is
built with random weights, one 1024 x 768 image)"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(label: str, model, encode) -> None:
    start = time.perf_counter()
    captured = encode()
    first = time.perf_counter() - start
    results = {}
    for way in ("graph", "eager"):
        if way == "eager":
            model.graph.close()
            model.graph.enabled = False
            encode()
        times = []
        for _ in range(10):
            start = time.perf_counter()
            results[way] = encode()
            times.append(time.perf_counter() - start)
        results[way + "_ms"] = statistics.median(times) * 1e3
    diff = np.abs(np.asarray(results["graph"]) - np.asarray(results["eager"])).max()
    print(f"{label}: first encode {first:.2f} s; warm, median of 10: graph {results['graph_ms']:.1f} ms, "
          f"eager {results['eager_ms']:.1f} ms; max |graph - eager| {diff:.1e}; "
          f"first == replayed: {np.array_equal(np.asarray(captured), np.asarray(results['graph']))}")


def main(model_dir: str) -> None:
    from moebus.workers.local import LocalModel
    from where_time_goes import qwen3vl_tower

    vision = LocalModel(model_dir, device="cuda", num_slots=1, max_context=64).vision
    cfg = vision.cfg
    pixels = np.random.default_rng(0).standard_normal((1, cfg.num_channels, cfg.image_size, cfg.image_size))
    timed(f"{cfg.tower} tower, {len(vision.layers)} layers, {cfg.image_size} px", vision,
          lambda: vision.encode(pixels))
    model, image = qwen3vl_tower()
    timed(f"Qwen3-VL tower, {model.cfg.depth} blocks, {image.grid_h}x{image.grid_w} patches", model,
          lambda: model.encode(image.patches, image.grid_h, image.grid_w)[0])


if __name__ == "__main__":
    main(sys.argv[1])
