"""The Qwen3-VL-30B-A3B tower (random bf16 weights, where_time_goes.qwen3vl_tower) on one 1024 x 768
image (48 x 64 patches), on cuda (tools/device/vltower9.sh), ninth session (branch vltower9).

First the new kernels' tests, called in this process (MOEBUS_TEST_GPU=1; a pytest run would compile
every kernel once more): rope_planes against its numpy twin bit for bit, the fused rotary + attention
(and its split store) against the unfused ops, the image kernel at hd 72 against its references, the
residual + LayerNorm pass against bias_residual then LayerNorm bit for bit (and with
VLTOWER9_TINY_TOWER=1 the tiny tower captured against eager and the cpu). Then the warm encode as a
graph (median of REPEATS) by phase, and variants in the same process, each re-captured, against the
default's outputs (max |diff| / max |default|, per output): the fused passes off one by one and
together (qwen3vl_vision.SPLIT_ATTENTION_OUT / FUSED_ROPE / FUSED_RESIDUAL), Q K's last half k-step
on k16 (the attention's HALF_KSTEP 0), all off (the eighth session's tower, with this session's
unrolled LayerNorm and bias + GELU kept), the host copies on 8 threads; graph == eager; the GPU time
by kernel of the default and of all off (torch.profiler's CUPTI trace).

    vltower9_encode.py [REPEATS]"""
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

os.environ.setdefault("MOEBUS_TEST_GPU", "1")  # tests.cuda.conftest: the real GPU, not the simulator
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vltower7_encode import REPEATS, _median_ms as median_ms, by_kernel  # noqa: E402

LEAN = os.environ.get("VLTOWER9_LEAN") == "1"  # vltower9_tower.sh: fewer tests, one profile (a short allowance)
VARIANTS = {  # label -> (FUSED_ROPE, FUSED_RESIDUAL, COPY_THREADS, flash IMAGE_DEFINES, SPLIT_ATTENTION_OUT);
    # None: the default's
    "attention output float32, split_rows before proj": (None, None, None, None, False),
    "rotary unfused (mrope x2, v's bias, split_planes)": (False, None, None, None, None),
    "residual unfused (bias_residual, then LayerNorm): must differ by 0": (None, False, None, None, None),
    "both unfused (the eighth session's passes)": (False, False, None, None, None),
    "attention: Q K's last 8 dims on k16 (HALF_KSTEP 0)": (None, None, None, (("HALF_KSTEP", 0),), None),
    "all off (the eighth session's tower, unrolled passes kept)": (False, False, None, (("HALF_KSTEP", 0),), None),
    "host copies on 8 threads": (None, None, 8, None, None),
}


def relative(a, b) -> str:
    """max |a - b| / max |b| per output (embeds, DeepStack)."""
    return ", ".join(f"{float(np.abs(x - y).max() / np.abs(y).max()):.1e}" for x, y in zip(a, b))


def gpu_tests() -> bool:
    from tests.cuda import test_flash_attention as fa, test_layernorm as ln
    from tests.vision import test_qwen3vl_tower_tc as tower

    cases = [("rope_planes kernel == twin, hd 72", lambda: fa.test_rope_planes_kernel_matches_ref_bit_for_bit(
                 np.random.default_rng(1), 72)),
             ("fused rotary + attention vs refs and unfused ops",
              lambda: fa.test_rope_image_attention_matches_the_unfused_ops(np.random.default_rng(3))),
             ("image kernel vs ref, hd 72", lambda: fa.test_image_kernel_matches_refs(np.random.default_rng(4), 72)),
             ("residual + LayerNorm == unfused, split",
              lambda: ln.test_residual_layernorm_is_bias_residual_then_layernorm_bit_for_bit(
                  np.random.default_rng(7), 2))]
    if LEAN:  # the tower's "residual unfused" variant checks that pass (it must differ by exactly 0)
        cases.pop()
    if os.environ.get("VLTOWER9_TINY_TOWER") == "1":  # ~13 s more (its own kernels' compiles): off in vltower9.sh
        cases.append(("tiny tower: captured == eager, vs cpu",
                      tower.test_a_captured_tensor_core_encode_equals_eager_and_the_cpu))
    ok = True
    for label, case in cases:
        start = time.perf_counter()
        try:
            case()
            print(f"test passed: {label} ({time.perf_counter() - start:.1f} s)")
        except Exception as e:  # noqa: BLE001 - report and go on: the timings stand or fall on their own
            ok = False
            print(f"test FAILED: {label}: {type(e).__name__}: {str(e)[:600]}")
            traceback.print_exc(limit=3)
    return ok


class Settings:
    def __init__(self):
        from moebus.cuda.kernels import flash_attention
        from moebus.workers import qwen3vl_vision, tower_graph

        self.places = {"rope": (qwen3vl_vision, "FUSED_ROPE"), "residual": (qwen3vl_vision, "FUSED_RESIDUAL"),
                       "threads": (tower_graph, "COPY_THREADS"), "defines": (flash_attention, "IMAGE_DEFINES"),
                       "split_out": (qwen3vl_vision, "SPLIT_ATTENTION_OUT")}
        self.default = {name: getattr(*place) for name, place in self.places.items()}

    def apply(self, values: tuple) -> None:
        from moebus.workers import tower_graph

        for (name, place), value in zip(self.places.items(), values):
            setattr(*place, self.default[name] if value is None else value)
        tower_graph._copy_pool.cache_clear()  # its pool was made for the old thread count

    def restore(self) -> None:
        self.apply((None,) * len(self.places))


def main() -> None:
    from vltower8_encode import phases
    from where_time_goes import qwen3vl_tower

    start = time.perf_counter()
    tests_ok = gpu_tests()
    print(f"GPU tests {'all passed' if tests_ok else 'NOT all passed'} in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    model, image = qwen3vl_tower()
    print(f"tower built in {time.perf_counter() - start:.1f} s: {model.cfg.depth} blocks, "
          f"{image.grid_h}x{image.grid_w} patches; graphs {model.graph.enabled}")
    encode = lambda: model.encode(image.patches, image.grid_h, image.grid_w)  # noqa: E731
    start = time.perf_counter()
    first = encode()
    print(f"first encode of the tower (eager run + capture; kernels compiled by the tests above): "
          f"{(time.perf_counter() - start) * 1e3:.0f} ms; graph key {model.graph.key}")
    model.graph.close()
    start = time.perf_counter()
    encode()
    print(f"a new size's encode, kernels loaded (eager run + capture): {(time.perf_counter() - start) * 1e3:.1f} ms")
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
    ms, again = median_ms(encode)
    print(f"default again (after the variants): {ms:.1f} ms; == the first default: "
          f"{all(np.array_equal(a, b) for a, b in zip(again, base))}")
    model.graph.enabled = False
    eager_ms, eager = median_ms(encode, 3)
    model.graph.enabled = True
    same = all(np.array_equal(a, b) for a, b in zip(base, eager))
    print(f"eager, median of 3: {eager_ms:.1f} ms; graph == eager: {same}")
    print("GPU time by kernel, default:")
    by_kernel(encode)
    if LEAN:
        print(f"summary: default {graph_ms:.1f} ms; " + "; ".join(f"{k} {v:.1f}" for k, v in results.items()))
        return
    unfused = VARIANTS["all off (the eighth session's tower, unrolled passes kept)"]
    settings.apply(unfused)
    model.graph.close()
    try:
        encode()
        print("GPU time by kernel, all off:")
        by_kernel(encode)
    finally:
        settings.restore()
        model.graph.close()
    print(f"summary: default {graph_ms:.1f} ms; " + "; ".join(f"{k} {v:.1f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
