"""The Qwen3-VL tower of a checkpoint on cuda, as the vision worker runs it (tools/device/vltower.sh):
the worker's warm-up, the first encode of one 1024 x 768 image (a new size: eager run + capture),
then warm encodes, median of REPEATS, captured (the default) and eager in the same process; how far
apart the two are; and the GPU time by kernel of one eager encode (torch.profiler, if torch is here).

    vltower_encode.py MODEL_DIR [REPEATS]   (an ``init-model --arch qwen3_vl_moe --preset a3b`` directory)"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _timed(run) -> tuple[float, object]:
    start = time.perf_counter()
    out = run()  # host arrays back: synchronized
    return time.perf_counter() - start, out


def _median_ms(run, repeats: int) -> tuple[float, float, object]:
    times, out = [], None
    for _ in range(repeats):
        seconds, out = _timed(run)
        times.append(seconds)
    return statistics.median(times) * 1e3, min(times) * 1e3, out


def _profile(run, rows: int = 12) -> None:
    try:
        import torch  # noqa: F401 - before the profiler
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("no torch here: no GPU time by kernel")
        return
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
    except Exception as e:  # noqa: BLE001 - the figures above stand without it
        print(f"no GPU time by kernel: {type(e).__name__}: {e}")
        return
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
    print(f"GPU kernels of one eager encode: {gpu_ms:.1f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=50))


def main(model_dir: str, repeats: int = 7) -> None:
    from PIL import Image

    from moebus.common.image_processor import load_image_processor
    from moebus.common.vision_config import load_vision_config
    from moebus.cuda.backends import make_backend
    from moebus.workers.vision_model import make_vision_model
    from moebus.workers.vision_weights import load_vision_weights

    cfg, processor = load_vision_config(model_dir), load_image_processor(model_dir)
    model = make_vision_model(cfg, load_vision_weights(model_dir), make_backend("cuda"))
    tc = model.ops.tensor_cores
    print(f"tower: {cfg.depth} blocks x {cfg.hidden_size}, {model.device_bytes / 2**20:.0f} MiB of weights; "
          f"tensor cores: {'cuBLAS, ' + tc.precision if tc else 'none'}; graphs: {model.graph.enabled}")
    seconds, _ = _timed(lambda: model.warm_up(processor))
    print(f"warm-up (as the worker's start): {seconds * 1e3:.0f} ms")
    image = processor.preprocess(Image.fromarray(np.random.default_rng(0).integers(0, 256, (768, 1024, 3), np.uint8)))
    encode = lambda: model.encode(image.patches, image.grid_h, image.grid_w)  # noqa: E731
    first_s, first = _timed(encode)
    print(f"1024x768 px -> {image.grid_h}x{image.grid_w} patches, {image.grid_h * image.grid_w // 4} tokens; "
          f"first encode (eager run + capture) {first_s * 1e3:.1f} ms")
    graph_ms, graph_min, graph = _median_ms(encode, repeats)
    model.graph.close()
    model.graph.enabled = False
    eager_ms, eager_min, eager = _median_ms(encode, repeats)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(graph, eager))
    print(f"warm encode, median of {repeats}: graph {graph_ms:.1f} ms (min {graph_min:.1f}), eager {eager_ms:.1f} ms "
          f"(min {eager_min:.1f}); max |graph - eager| {diff:.1e}; first == replayed: "
          f"{all(np.array_equal(a, b) for a, b in zip(first, graph))} (target <= 30 ms)")
    _profile(encode)
    from moebus.cuda.kernels import prefill_attention

    default = prefill_attention.MAX_SCORE_BYTES
    for mib in (64, 16):  # query blocks of ~400 and 64 rows: less scratch; at 16 MiB S and P fit in L2
        prefill_attention.MAX_SCORE_BYTES = mib << 20
        ms, _, out = _median_ms(encode, repeats)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(out, eager))
        print(f"eager with attention scores of <= {mib} MiB a block (default {default >> 20}): {ms:.1f} ms; "
              f"max |difference| {diff:.1e}")
    prefill_attention.MAX_SCORE_BYTES = default


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
