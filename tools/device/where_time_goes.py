"""Where the time of a long prefill step and of the vision towers goes, in one process per call:
wall time (median of 3 after a warm-up), GPU kernel time by kernel (torch.profiler's CUPTI trace
sees numba's and cuBLAS's kernels alike) and the host's own time by function (cProfile).

    where_time_goes.py prefill MODEL_DIR TOKENS   (one sequence of TOKENS tokens, LocalModel.step)
    where_time_goes.py so400m MODEL_DIR           (the LLaVA tower of MODEL_DIR, one image)
    where_time_goes.py qwen3vl                    (the Qwen3-VL-30B-A3B tower, random weights, 1024 x 768 px)"""
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def measure(label: str, run, repeats: int = 3, kernels: int = 12, functions: int = 14) -> None:
    import torch  # noqa: F401 - before the profiler
    from torch.profiler import ProfilerActivity, profile

    run()  # warm-up: compiles or loads every kernel, fills the pools
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
    print(f"== {label}: wall {statistics.median(times) * 1e3:.1f} ms (median of {repeats}), "
          f"GPU kernels {gpu_ms:.1f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=kernels, max_name_column_width=60))
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(functions)


def prefill(model_dir: str, num_tokens: int) -> None:
    from moebus.workers.batch import StepBatch
    from moebus.workers.local import LocalModel

    model = LocalModel(model_dir, device="cuda", num_slots=1, max_context=num_tokens + 8)
    batch = StepBatch(slots=[0], starts=[0], lengths=[num_tokens],
                      tokens=[(7 * i + 3) % 1000 + 10 for i in range(num_tokens)])
    measure(f"prefill of {num_tokens} tokens, {model.ckpt.config.num_layers} layers", lambda: model.step(batch))


def so400m(model_dir: str) -> None:
    from moebus.workers.local import LocalModel

    vision = LocalModel(model_dir, device="cuda", num_slots=1, max_context=64).vision
    cfg = vision.cfg
    pixels = np.random.default_rng(0).standard_normal((1, cfg.num_channels, cfg.image_size, cfg.image_size))
    measure(f"{cfg.tower} tower, {len(vision.layers)} layers, {cfg.image_size} px", lambda: vision.encode(pixels),
            repeats=5)


def qwen3vl_tower():
    """The Qwen3-VL-30B-A3B tower (random bf16 weights) on cuda and one 1024 x 768 image."""
    from PIL import Image

    from moebus.common.qwen3vl_config import parse_qwen3_vision_config
    from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor
    from moebus.common.qwen3vl_tiny import preprocessor_config, qwen3vl_config, vision_tensors
    from moebus.common.tiny_model import _Random, hf_config
    from moebus.cuda.backends import make_backend
    from moebus.cuda.dtypes import f32_to_bf16
    from moebus.workers.qwen3vl_vision import Qwen3VisionModel

    raw = qwen3vl_config(hf_config("qwen3_moe", "a3b"), "a3b", dict(image_token_id=151655))
    cfg = parse_qwen3_vision_config(raw)
    weights = {k[len("model.visual."):]: f32_to_bf16(v) for k, v in vision_tensors(raw, _Random(1, False)).items()}
    model = Qwen3VisionModel(cfg, weights, make_backend("cuda"))
    image = Qwen3VLImageProcessor(preprocessor_config(raw, "a3b")).preprocess(
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (768, 1024, 3), dtype=np.uint8)))
    return model, image


def qwen3vl() -> None:
    model, image = qwen3vl_tower()
    measure(f"Qwen3-VL tower, {model.cfg.depth} blocks, {image.grid_h}x{image.grid_w} patches",
            lambda: model.encode(image.patches, image.grid_h, image.grid_w), repeats=5)


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    {"prefill": lambda: prefill(args[0], int(args[1])), "so400m": lambda: so400m(args[0]), "qwen3vl": qwen3vl}[what]()
