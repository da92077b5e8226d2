"""Issue 18, fifteenth session (branch vl15), in tools/device/vl15.sh's call: the Qwen3-VL-30B-A3B tower's
warm encode of one 1024 x 768 image (48 x 64 patches, random bf16 weights) with this branch's switches,
each against integ15's way:

- ``held``: MOEBUS_LAYERNORM_HELD (cuda/kernels/layernorm_held.py: LayerNorm and residual + LayerNorm with
  each row held in registers, one read of it instead of three);
- ``two``: MOEBUS_SPLIT_TWO_PARTS (cuda/kernels/split_two_parts.py: bias + GELU into two parts, unsigned
  columns);
- ``beside``: MOEBUS_TOWER_COLLECT_BESIDE (workers/tower_graph.py: the DeepStack features copied out while
  the last blocks run; the eleventh session measured it 30.6 against 31.2 ms, never flipped);
- ``pairs``: MOEBUS_FLASH_ROPE_PAIRS (flash_planes.cuh's rope_planes: a thread per rotary pair);
- ``frame``: MOEBUS_PATCHIFY_BY_FRAME (cuda/kernels/patchify.py: a thread per pixel of a patch).

    vl15_encode.py warm      the weights made and saved (WEIGHTS), every way encoded once (compiles), no timing
    vl15_encode.py [REPEATS] each way re-captured, its warm encode as a graph (median of REPEATS) and its outputs
                             against the first way's (bits equal, or max |diff| / max |first|); one replay by
                             phase; the GPU time by kernel and the gaps between kernels (torch.profiler's CUPTI);
                             a summary last. Each step only while BUDGET_S seconds last."""
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

WARM = len(sys.argv) > 1 and sys.argv[1] == "warm"
REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 and not WARM else 20
END = time.monotonic() + float(os.environ.get("BUDGET_S", "45"))
WEIGHTS = os.environ.get("WEIGHTS", "/tmp/vl15-tower.npz")
SWITCHES = {"held": ("moebus.cuda.kernels.layernorm_held", "HELD"),
            "two": ("moebus.cuda.kernels.split_two_parts", "TWO_PARTS"),
            "beside": ("moebus.workers.tower_graph", "COLLECT_BESIDE"),
            "pairs": ("moebus.cuda.kernels.flash_attention", "IMAGE_DEFINES"),
            "frame": ("moebus.cuda.kernels.patchify", "BY_FRAME")}
ALL = tuple(SWITCHES)
DEFAULTS = ("held", "two", "beside", "pairs")  # on by default since call A (frame stays opt-in)
WAYS = [("old", ()), ("defaults", DEFAULTS), ("all", ALL), ("beside", ("beside",)), ("held", ("held",)),
        ("two", ("two",)), ("pairs", ("pairs",)), ("frame", ("frame",)), ("held 2 warps", DEFAULTS + ("warps2",)),
        ("held 1 warp", DEFAULTS + ("warps1",)), ("old again", ()), ("defaults again", DEFAULTS)]


def left() -> float:
    return END - time.monotonic()


def set_switches(on) -> None:
    import importlib

    for name, (module, attribute) in SWITCHES.items():
        module = importlib.import_module(module)
        if attribute == "IMAGE_DEFINES":  # a compile-time define of the attention's module, not a flag
            others = tuple(d for d in module.IMAGE_DEFINES if d[0] != "ROPE_PAIRS")
            module.IMAGE_DEFINES = others + ((("ROPE_PAIRS", 1),) if name in on else ())
        else:
            setattr(module, attribute, name in on)
    held = importlib.import_module("moebus.cuda.kernels.layernorm_held")  # warps a block of its kernels: 4, 2 or 1
    held.BLOCK_WARPS = 1 if "warps1" in on else 2 if "warps2" in on else 4


def tower():
    """where_time_goes.qwen3vl_tower's model and image, its weights from WEIGHTS where saved (making them
    takes ~10-25 s of numpy)."""
    from PIL import Image

    from moebus.common.qwen3vl_config import parse_qwen3_vision_config
    from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor
    from moebus.common.qwen3vl_tiny import preprocessor_config, qwen3vl_config, vision_tensors
    from moebus.common.tiny_model import _Random, hf_config
    from moebus.cuda.backends import make_backend
    from moebus.cuda.dtypes import f32_to_bf16
    from moebus.workers.qwen3vl_vision import Qwen3VisionModel

    raw = qwen3vl_config(hf_config("qwen3_moe", "a3b"), "a3b", dict(image_token_id=151655))
    if os.path.exists(WEIGHTS):
        with np.load(WEIGHTS) as saved:
            weights = {name: saved[name] for name in saved.files}
    else:
        weights = {k[len("model.visual."):]: f32_to_bf16(v) for k, v in vision_tensors(raw, _Random(1, False)).items()}
        if WARM:
            np.savez(WEIGHTS + ".part.npz", **weights)
            os.replace(WEIGHTS + ".part.npz", WEIGHTS)
    model = Qwen3VisionModel(parse_qwen3_vision_config(raw), weights, make_backend("cuda"))
    image = Qwen3VLImageProcessor(preprocessor_config(raw, "a3b")).preprocess(
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (768, 1024, 3), dtype=np.uint8)))
    return model, image


def relative(a, b) -> str:
    return ", ".join(f"{float(np.abs(x - y).max() / np.abs(y).max()):.1e}" for x, y in zip(a, b))


def measure(model, image, label, on, first):
    """(warm ms, outputs) of one way, re-captured; prints its line."""
    set_switches(on)
    model.graph.close()
    encode = lambda: model.encode_image(image)  # noqa: E731
    began = time.perf_counter()
    eager = encode()  # a new graph: eager (the kernels of this way load now)
    encode()  # the capture, then a replay
    setup_s = time.perf_counter() - began
    if WARM:
        print(f"{label}: compiled and captured in {setup_s:.1f} s ({model.graph.last_path})")
        return None, eager
    from vltower7_encode import _median_ms as median_ms  # (it reads sys.argv[1] as REPEATS: not in the warm phase)

    ms, out = median_ms(encode, REPEATS)
    diff = "(the reference)" if first is None else "bits equal" if all(
        np.array_equal(a, b) for a, b in zip(out, first)) else "max |diff| / max |first| " + relative(out, first)
    same = all(np.array_equal(a, b) for a, b in zip(out, eager))
    print(f"{label:<14} warm {ms:6.2f} ms (median of {REPEATS}; {model.graph.last_path}; eager + capture "
          f"{setup_s:.2f} s); replay == eager {same}; {diff}")
    return ms, out


def timeline(model, image, label: str, runs: int = 3) -> None:
    """GPU time by kernel of a replayed encode and the time between kernels (CUPTI, via torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    from vltower7_encode import short_name

    encode = lambda: model.encode_image(image)  # noqa: E731
    encode()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            encode()
    spans, rows = [], defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            spans.append((e.time_range.start, e.time_range.end))
            row = rows[short_name(e.name)]
            row[0] += 1
            row[1] += e.device_time_total
    spans.sort()
    busy, gaps, gap_us, end = 0.0, 0, 0.0, None
    for start, stop in spans:  # the union of the kernels' and copies' intervals, gaps under 1 ms (not between encodes)
        if end is not None and start > end:
            if start - end < 1000:
                gaps, gap_us = gaps + 1, gap_us + (start - end)
        busy += max(0.0, stop - max(start, end or start))
        end = stop if end is None else max(end, stop)
    total = sum(r[1] for r in rows.values()) / runs
    print(f"GPU of one replayed encode ({label}): kernels + copies {total / 1e3:.2f} ms, busy {busy / runs / 1e3:.2f} ms, "
          f"{gaps / runs:.0f} gaps between them {gap_us / runs / 1e3:.2f} ms ({gap_us / max(gaps, 1):.2f} us each)")
    for name, (calls, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {name[:52]:<52} {calls / runs:>4.0f} x {us / calls:7.1f} us = {us / runs / 1e3:6.2f} ms")


def main() -> None:
    start = time.perf_counter()
    model, image = tower()
    print(f"tower built in {time.perf_counter() - start:.1f} s ({model.cfg.depth} blocks, {image.grid_h}x{image.grid_w} "
          f"patches, graphs {model.graph.enabled})")
    results, first = {}, None
    for label, on in WAYS:
        if left() < 5 or (WARM and label == "old again"):
            print(f"{label}: skipped ({left():.0f} s left)")
            continue
        try:
            ms, out = measure(model, image, label, on, first)
            first = out if first is None else first
            results[label] = ms
        except Exception as e:  # noqa: BLE001 - one way failing leaves the others
            print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=4)
    if WARM:
        return
    for label, on in (("old", ()), ("defaults", DEFAULTS)):
        if left() < 6:
            print(f"by kernel, {label}: skipped ({left():.0f} s left)")
            continue
        set_switches(on)
        model.graph.close()
        print(f"== {label}:")
        try:
            if label != "old":
                from vltower8_encode import phases

                phases(model, image)
            timeline(model, image, label)
        except Exception as e:  # noqa: BLE001
            print(f"by kernel, {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
    print("SUMMARY tower 1024x768 warm (median of %d): %s" % (REPEATS, " | ".join(
        f"{label} {ms:.2f}" for label, ms in results.items() if ms is not None)))


if __name__ == "__main__":
    if not WARM:
        import vltower8_encode

        vltower8_encode.REPEATS = REPEATS  # (phases' repeats)
    main()
