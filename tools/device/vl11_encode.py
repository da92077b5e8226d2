"""Issue 18, eleventh session (branch vl11), in tools/device/vl11.sh's one call: the image's bytes in
(patchified on the device, cuda/kernels/patchify.py) and the DeepStack features copied out beside the
later blocks (tower_graph.emit), against the float32 patches in and every copy after the last kernel.

1. the host's preprocess of a 1024 x 768 image: the bytes and their values (now) against the float32
   patches (before), median of 5;
2. the a3b tower (where_time_goes.qwen3vl_tower: random bf16 weights, one 1024 x 768 image): the
   warm encode as a graph, median of REPEATS, in five ways — patches or bytes in, early copies off or
   on, and the opt-in COLLECT_BESIDE (the host copies DeepStack out while the last blocks run) — each
   against the first's outputs (bits equal, or max |diff| / max |first|); the patchify
   kernel alone (CUDA events); one replay by phase (vltower8_encode.phases); the GPU time by kernel (CUPTI);
3. fidelity on cuda against transformers (qwen3vl_check.fidelity: one, two and no images; the
   images now go through the bytes path);
   each step only while BUDGET_S seconds last.

    vl11_encode.py [REPEATS]"""
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
END = time.monotonic() + float(os.environ.get("BUDGET_S", "60"))


def left() -> float:
    return END - time.monotonic()


def fidelity() -> None:
    from qwen3vl_check import fidelity as check

    print(f"fidelity on cuda: {'ok' if check() else 'FAILED'}")


def preprocess_times(image_px=(768, 1024)) -> None:
    from PIL import Image
    from vltower7_encode import _median_ms as median_ms

    from moebus.common.qwen3vl_image_processor import Qwen3VLImageProcessor, patchify
    from moebus.common.qwen3vl_tiny import preprocessor_config, qwen3vl_config
    from moebus.common.tiny_model import hf_config

    raw = qwen3vl_config(hf_config("qwen3_moe", "a3b"), "a3b", dict(image_token_id=151655))
    proc = Qwen3VLImageProcessor(preprocessor_config(raw, "a3b"))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, image_px + (3,), dtype=np.uint8))
    new_ms, prepared = median_ms(lambda: proc.preprocess(image), 5)

    def float_patches():  # the processor's way before: every pixel rescaled and normalized, then patchified
        floats = np.moveaxis(proc.rescaled_normalized(proc.resized(image)), -1, 0).astype(np.float32)
        return patchify(floats, proc.patch_size, proc.merge_size, proc.temporal_patch_size)

    old_ms, old = median_ms(float_patches, 5)
    assert np.array_equal(old.patches, prepared.patches)
    print(f"host preprocess of a {image_px[1]}x{image_px[0]} image, median of 5: bytes + values {new_ms:.1f} ms "
          f"({prepared.pixels.nbytes / 1e6:.1f} MB to send); float32 patches {old_ms:.1f} ms "
          f"({prepared.patches.nbytes / 1e6:.1f} MB)")


def relative(a, b) -> str:
    return ", ".join(f"{float(np.abs(x - y).max() / np.abs(y).max()):.1e}" for x, y in zip(a, b))


def patchify_alone(model, image) -> None:
    from moebus.cuda.kernels.compat import cuda

    ops, cfg = model.ops, model.cfg
    pixels, values = ops.weight(image.pixels), ops.weight(image.values)
    ops.begin_step()
    ops.pixel_patches(pixels, values, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    ops.synchronize()
    e0, e1 = cuda.event(), cuda.event()
    e0.record(ops.stream)
    for _ in range(10):
        ops.pixel_patches(pixels, values, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    e1.record(ops.stream)
    e1.synchronize()
    print(f"patchify kernel alone ({image.grid_h * image.grid_w} patches): "
          f"{cuda.event_elapsed_time(e0, e1) / 10 * 1e3:.1f} us a call")
    ops.begin_step()


def tower() -> None:
    from vltower7_encode import _median_ms as median_ms, by_kernel
    from where_time_goes import qwen3vl_tower

    from moebus.workers import tower_graph

    start = time.perf_counter()
    model, image = qwen3vl_tower()
    by_patches = lambda: model.encode(image.patches, image.grid_h, image.grid_w)  # noqa: E731
    by_bytes = lambda: model.encode_image(image)  # noqa: E731
    ways = [("patches in, copies after the last kernel (vltower10's way)", by_patches, False, False),
            ("patches in, DeepStack copied early", by_patches, True, False),
            ("bytes in, copies after the last kernel", by_bytes, False, False),
            ("bytes in, DeepStack copied early (the new default)", by_bytes, True, False)]
    beside = ("bytes in, DeepStack copied early and collected beside (COLLECT_BESIDE)", by_bytes, True, True)
    first, graphs_on = None, model.graph.enabled

    def measure(label, encode, early, collect_beside) -> None:
        nonlocal first
        if left() < 6:
            print(f"{label}: skipped (budget)")
            return
        tower_graph.EARLY_COPIES, tower_graph.COLLECT_BESIDE = early, collect_beside
        model.graph.close()
        try:
            began = time.perf_counter()
            eager = encode()  # a new shape (the inputs' names): eager
            eager_ms = (time.perf_counter() - began) * 1e3
            began = time.perf_counter()
            encode()  # the capture, then the replay
            capture_ms = (time.perf_counter() - began) * 1e3
            path = model.graph.last_path
            ms, out = median_ms(encode, REPEATS)
            if first is None:
                first, diff = out, f"(the reference; built + first encode {time.perf_counter() - start:.1f} s)"
            else:
                diff = "bits equal" if all(np.array_equal(a, b) for a, b in zip(out, first)) else \
                    "max |diff| / max |first| " + relative(out, first)
            same = all(np.array_equal(a, b) for a, b in zip(out, eager))
            print(f"{label}: warm {ms:.1f} ms (median of {REPEATS}; {path}); eager first {eager_ms:.0f} ms, "
                  f"capture + replay {capture_ms:.0f} ms; replay == eager {same}; {diff}")
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=3)
        if graphs_on and not model.graph.enabled:
            print("the graph was turned off by a failed capture: what follows is eager")

    from vltower8_encode import phases

    marker = os.environ.get("WAIT_FOR")  # the machine's other work (init-model) done before the timing
    waited = time.monotonic()
    while marker and not os.path.exists(marker) and time.monotonic() - waited < 40 and left() > 20:
        time.sleep(0.5)
    if marker:
        print(f"(waited {time.monotonic() - waited:.1f} s for {marker}: {os.path.exists(marker)})")
    old, new = ways[0], ways[3]
    for way in (old, new):
        measure(*way)
    if left() > 4:
        patchify_alone(model, image)
    if left() > 8:
        phases(model, image)  # (the new default's graph: patchify_alone used the backend's pool, not the graph's)
    for way in ways[1:3]:
        measure(*way)
    if left() > 14 and os.environ.get("BY_KERNEL", "1") == "1":
        measure(*new)  # (again: the graph of the new default, measured once more)
        print("GPU time by kernel (bytes in, early copies):")
        by_kernel(by_bytes, 3)
    measure(*beside)  # last: a capture this way fails would turn the graph off for what follows
    if left() > 8 and model.graph.enabled:
        phases(model, image)
    tower_graph.EARLY_COPIES, tower_graph.COLLECT_BESIDE = True, False


def main() -> None:
    steps = (preprocess_times, tower, fidelity) if os.environ.get("FIDELITY", "1") == "1" else (preprocess_times, tower)
    for step in steps:  # fidelity last: it compiles the text kernels
        if left() < 5:
            print(f"{step.__name__}: skipped (budget)")
            continue
        start = time.perf_counter()
        try:
            step()
        except Exception as e:  # noqa: BLE001
            print(f"{step.__name__} FAILED: {type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc(limit=3)
        print(f"({step.__name__}: {time.perf_counter() - start:.1f} s; {left():.0f} s left)")


if __name__ == "__main__":
    main()
