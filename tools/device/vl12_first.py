"""Issue 18, twelfth session (branch vl12): why a new image size's first encode (eager, ~181 ms at
1024 x 1024 in the eleventh session's cycle) costs so much more than a replay (~50 ms), and what the
vision worker's blank-image warm-up (~0.28 s) spends. One fresh process, the PRESET's Qwen3-VL tower
(random bf16 weights, where_time_goes.qwen3vl_tower's way, packed as the zygote packs them), in order:

  1. the warm-up (VisionModel.warm_up: the blank image of warm_up_side patches a side), then again
     eagerly (its graph closed): the same pass with every kernel loaded;
  2. image A's first encode (a new size: eager in the graph-to-be's pool), then its capture
     (capture_pending), then replays (median);
  3. image B (another size, every kernel loaded now): its first encode, eager;
  4. A again after the graph's close (a new pool, but A's products seen before): eager;
  5. A eagerly on the backend's own pool (no graph; MOEBUS_CUDA_GRAPHS=0's way), twice: the second
     has every buffer in the pool already, so it is launches + GPU only.

Each timed step is also run under cProfile (PROFILE=1; its overhead is in those steps' times, so the
un-profiled figures are the ones to quote: PROFILE=2, the default, profiles only steps 1, 2 and 5b: the
worker's log has the un-profiled warm-up, step 3 is step 2's case un-profiled; PROFILE=0 none). The
profiles' top functions by own time go to stdout and $OUT/vl12_first_<step>.txt (by cumulative time: _cum.txt).

    vl12_first.py [A_PX] [B_PX]    (sides in pixels, e.g. 1024x1024 768x1024: height x width)"""
import cProfile
import io
import os
import pstats
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PRESET = os.environ.get("PRESET", "a3b")
PROFILE = os.environ.get("PROFILE", "2")
OUT = os.environ.get("OUT", "/tmp")
TOP = int(os.environ.get("TOP", "14"))


def size(arg: str, default: str) -> tuple[int, int]:
    h, w = (arg or default).split("x")
    return int(h), int(w)


def tower():
    """The PRESET's tower on cuda (its weights packed in one host buffer, as the zygote does) and its processor."""
    from moebus.common.qwen3vl_config import parse_qwen3_vision_config
    from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor
    from moebus.common.qwen3vl_tiny import preprocessor_config, qwen3vl_config, vision_tensors
    from moebus.common.tiny_model import _Random, hf_config
    from moebus.cuda.backends import make_backend
    from moebus.cuda.dtypes import f32_to_bf16
    from moebus.workers.vision_model import make_vision_model
    from moebus.workers.vision_weight_pack import pack

    raw = qwen3vl_config(hf_config("qwen3_moe", PRESET), PRESET, dict(image_token_id=151655))
    cfg = parse_qwen3_vision_config(raw)
    weights = {k[len("model.visual."):]: f32_to_bf16(v) for k, v in vision_tensors(raw, _Random(1, False)).items()}
    weights = pack(weights)
    backend = make_backend("cuda")
    started = time.perf_counter()
    model = make_vision_model(cfg, weights, backend)
    if getattr(model, "packed", None) is not None:
        model.packed.wait()
    print(f"model built on cuda in {time.perf_counter() - started:.3f} s ({cfg.depth} blocks)", flush=True)
    return model, Qwen3VLImageProcessor(preprocessor_config(raw, PRESET))


def image(processor, hw):
    from PIL import Image

    pixels = np.random.default_rng(hw[0] * 7 + hw[1]).integers(0, 256, hw + (3,), dtype=np.uint8)
    return processor.preprocess(Image.fromarray(pixels))


def timed(label: str, fn, profile: bool):
    """fn() once: its wall ms (a sync at the end) and, with ``profile``, the top functions by own time."""
    ops_sync = _sync
    profiler = cProfile.Profile() if profile else None
    began = time.perf_counter()
    if profiler:
        profiler.enable()
    out = fn()
    ops_sync()
    if profiler:
        profiler.disable()
    ms = (time.perf_counter() - began) * 1e3
    print(f"{label}: {ms:.1f} ms{' (profiled)' if profile else ''}", flush=True)
    if profiler:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
        stats.print_stats(TOP)
        body = text.getvalue()
        name = re.sub(r"[^A-Za-z0-9]+", "_", label.split(":")[0].split(" (")[0]).strip("_")[:40]
        Path(OUT, f"vl12_first_{name}.txt").write_text(body)
        cum = io.StringIO()
        pstats.Stats(profiler, stream=cum).sort_stats("cumulative").print_stats(40)
        Path(OUT, f"vl12_first_{name}_cum.txt").write_text(cum.getvalue())
        lines = [ln for ln in body.splitlines() if ln.strip() and ln.lstrip()[:1].isdigit()]
        for ln in lines[:TOP]:
            print("   ", ln.strip()[:170])
    return ms, out


_sync = lambda: None  # noqa: E731 - set in main once the backend exists


def main() -> None:
    global _sync
    a_hw = size(sys.argv[1] if len(sys.argv) > 1 else "", "1024x1024")
    b_hw = size(sys.argv[2] if len(sys.argv) > 2 else "", "768x1024")
    model, processor = tower()
    _sync = model.ops.synchronize
    a, b = image(processor, a_hw), image(processor, b_hw)
    every = PROFILE == "1"
    timed("1. warm-up (blank image)", lambda: model.warm_up(processor), every or PROFILE == "2")
    model.graph.close()
    timed("1b. warm-up again, eager (every kernel loaded)", lambda: model.warm_up(processor), False)
    timed(f"2. A {a.grid_h}x{a.grid_w} patches, first encode ({model.graph.enabled and 'graph on'})",
          lambda: model.encode_image(a), every or PROFILE == "2")
    print(f"   path {model.graph.last_path}")
    started = time.perf_counter()
    seconds = model.capture_pending()
    print(f"2b. A's capture after the reply: {1e3 * (time.perf_counter() - started):.1f} ms ({seconds})")
    times = [timed("2c. A replay", lambda: model.encode_image(a), False)[0] for _ in range(5)]
    print(f"2c. A replay median of 5: {sorted(times)[2]:.1f} ms ({model.graph.last_path})")
    timed(f"3. B {b.grid_h}x{b.grid_w} patches, first encode", lambda: model.encode_image(b), every)
    print(f"   path {model.graph.last_path}")
    timed("3b. B second encode (capture + replay)", lambda: model.encode_image(b), False)
    model.graph.close()
    timed("4. A again after close (new pool, seen products)", lambda: model.encode_image(a), every)
    print(f"   path {model.graph.last_path}")
    model.graph.close()
    model.graph.enabled = False
    timed("5a. A eager on the backend's pool (no graph), first", lambda: model.encode_image(a), every)
    timed("5b. A eager on the backend's pool, second", lambda: model.encode_image(a), every or PROFILE == "2")
    timed("5c. A eager on the backend's pool, third", lambda: model.encode_image(a), False)


if __name__ == "__main__":
    main()
