"""Issue 18, tenth session (branch vltower10), one short call (tools/device/vltower10.sh PART=2): what
the ninth session left opt-in, and the fused attention at 32 query rows a warp.

1. The image attention alone (3072 patches = one 1024 x 768 image, 16 heads, hd 72, split; planes +
   fused kernel, 5 calls between two CUDA events): the kernel's layouts (IMAGE_WARPS x
   IMAGE_WARP_ROWS, MIN_BLOCKS, TILE_KEYS) and HALF_KSTEP on/off, each against the first row's output
   (bits equal or max |diff|): every layout must equal it bit for bit (a row's arithmetic is the same).
2. In-process GPU tests (tests/cuda/test_flash_attention.py): the image kernel at 32 rows a warp
   against its references, rope_planes against its numpy twin bit for bit, the fused rotary +
   attention (and its split store) against the unfused ops, each at the layout of step 3.
3. The a3b tower (random bf16 weights, one 1024 x 768 image) with the opt-ins of the environment:
   the warm encode as a graph (median of REPEATS), variants re-captured in the same process against
   it (max |diff| / max |default| per output: embeds, DeepStack), graph == eager, the GPU time by
   kernel (torch.profiler's CUPTI trace); each step only while BUDGET_S seconds last.

    vltower10_encode.py [REPEATS]"""
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

os.environ.setdefault("MOEBUS_TEST_GPU", "1")  # tests.cuda.conftest: the real GPU, not the simulator
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
END = time.monotonic() + float(os.environ.get("BUDGET_S", "40"))
FAST = (("IMAGE_WARPS", int(os.environ.get("VLTOWER10_WARPS", "4"))),
        ("IMAGE_WARP_ROWS", int(os.environ.get("VLTOWER10_ROWS", "32"))))  # the layout steps 2-3 try


def left() -> float:
    return END - time.monotonic()


def half_kstep_other(defines: tuple) -> tuple:
    """The attention's defines with HALF_KSTEP the other way."""
    on = ("HALF_KSTEP", 0) not in defines
    return tuple(d for d in defines if d[0] != "HALF_KSTEP") + ((("HALF_KSTEP", 0),) if on else ())


class Knobs:
    """flash_attention's image settings, set and put back."""

    NAMES = ("IMAGE_WARPS", "IMAGE_WARP_ROWS", "IMAGE_DEFINES")

    def __init__(self):
        from moebus.cuda.kernels import flash_attention as fa

        self.fa, self.default = fa, {n: getattr(fa, n) for n in self.NAMES}

    def set(self, **values) -> None:
        for name in self.NAMES:
            setattr(self.fa, name, values.get(name, self.default[name]))

    def reset(self) -> None:
        self.set()


def attention_alone(knobs: Knobs) -> None:
    from moebus.cuda.backends.cuda import CudaBackend
    from moebus.cuda.kernels.compat import cuda
    from moebus.cuda.kernels.vision_attention import image_attention_cuda

    ops, base = CudaBackend(), knobs.default["IMAGE_DEFINES"]
    positions, heads, hd = int(os.environ.get("VLTOWER10_PATCHES", "3072")), 16, 72
    rng = np.random.default_rng(positions)
    q, k, v = (ops.weight(rng.standard_normal((positions, heads, hd), dtype=np.float32)) for _ in range(3))
    out = cuda.device_array(q.shape, np.float32)  # not the step pool's: begin_step() below recycles that
    variants = [("8 warps x 16 rows (the default layout)", {}),
                ("4 warps x 32 rows", dict(IMAGE_WARPS=4, IMAGE_WARP_ROWS=32)),
                ("8 warps x 32 rows", dict(IMAGE_WARPS=8, IMAGE_WARP_ROWS=32)),
                ("4 warps x 16 rows, 3 blocks an SM", dict(IMAGE_WARPS=4, IMAGE_DEFINES=base + (("MIN_BLOCKS", 3),))),
                (f"8 x 16, HALF_KSTEP {'off' if ('HALF_KSTEP', 0) not in base else 'on'} (the other way)",
                 dict(IMAGE_DEFINES=half_kstep_other(base))),
]
    print(f"== image attention alone: {positions} patches, {heads} heads, hd {hd}, split; defines {base}")
    first = None
    for label, values in variants:
        if left() < 8:
            print(f"{label}: skipped (budget)")
            continue
        knobs.set(**values)
        try:
            start = time.perf_counter()
            ops.begin_step()
            image_attention_cuda(ops, q, k, v, 1, hd ** -0.5, out)  # compiles (NVRTC) and loads
            ops.stream.synchronize()
            compile_s = time.perf_counter() - start
            times = []
            for _ in range(3):
                ops.begin_step()
                e0, e1 = cuda.event(), cuda.event()
                e0.record(ops.stream)
                for _ in range(5):
                    image_attention_cuda(ops, q, k, v, 1, hd ** -0.5, out)
                e1.record(ops.stream)
                e1.synchronize()
                times.append(cuda.event_elapsed_time(e0, e1) / 5)
            got = ops.to_host(out)
            ms = statistics.median(times)
            tflops = 4 * positions * positions * heads * hd / ms / 1e9
            if first is None:
                first, diff = got, "(the reference)"
            else:
                diff = "bits equal" if np.array_equal(got, first) else f"max |diff| {float(np.abs(got - first).max()):.2e}"
            print(f"{label}: {ms:.3f} ms a call ({tflops:.1f} TFLOP/s useful; first call {compile_s:.1f} s); {diff}")
        except Exception as e:  # noqa: BLE001 - one layout failing leaves the others
            print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}")
        finally:
            knobs.reset()


def gpu_tests(knobs: Knobs) -> None:
    from tests.cuda import test_flash_attention as fa

    cases = [("image kernel vs refs, hd 72, 4 x 32 rows", lambda: fa.test_image_kernel_matches_refs(
                 np.random.default_rng(4), 72), dict(FAST)),
             ("rope_planes kernel == twin, hd 72", lambda: fa.test_rope_planes_kernel_matches_ref_bit_for_bit(
                 np.random.default_rng(1), 72), {}),
             ("fused rotary + attention (+ split store) vs refs and unfused ops, 4 x 32 rows",
              lambda: fa.test_rope_image_attention_matches_the_unfused_ops(np.random.default_rng(3)), dict(FAST))]
    for label, case, values in cases:
        if left() < 6:
            print(f"test skipped (budget): {label}")
            continue
        knobs.set(**values)
        start = time.perf_counter()
        try:
            case()
            print(f"test passed: {label} ({time.perf_counter() - start:.1f} s)")
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"test FAILED: {label}: {type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc(limit=2)
        finally:
            knobs.reset()


def relative(a, b) -> str:
    return ", ".join(f"{float(np.abs(x - y).max() / np.abs(y).max()):.1e}" for x, y in zip(a, b))


def tower(knobs: Knobs) -> None:
    from vltower7_encode import _median_ms as median_ms, by_kernel
    from where_time_goes import qwen3vl_tower

    from moebus.cuda.kernels import split_epilogues
    from moebus.workers import qwen3vl_vision as qv

    start = time.perf_counter()
    model, image = qwen3vl_tower()
    encode = lambda: model.encode(image.patches, image.grid_h, image.grid_w)  # noqa: E731
    first = encode()
    print(f"== tower: built + first encode {time.perf_counter() - start:.1f} s; {model.cfg.depth} blocks, "
          f"{image.grid_h}x{image.grid_w} patches; FUSED_ROPE {qv.FUSED_ROPE}, SPLIT_ATTENTION_OUT "
          f"{qv.SPLIT_ATTENTION_OUT}, FUSED_RESIDUAL {qv.FUSED_RESIDUAL}, PAIRED_STORES "
          f"{split_epilogues.PAIRED_STORES}, attention {knobs.default}")
    ms, base = median_ms(encode)
    print(f"warm encode as a graph, median of {REPEATS}: {ms:.1f} ms (target <= 30); first == replayed: "
          f"{all(np.array_equal(a, b) for a, b in zip(first, base))}")
    flips = [("attention 4 warps x 32 rows", dict(FAST), {}),
             ("FUSED_ROPE the other way", {}, dict(FUSED_ROPE=not qv.FUSED_ROPE)),
             ("SPLIT_ATTENTION_OUT the other way", {}, dict(SPLIT_ATTENTION_OUT=not qv.SPLIT_ATTENTION_OUT)),
             ("attention HALF_KSTEP the other way", dict(IMAGE_DEFINES=half_kstep_other(knobs.default["IMAGE_DEFINES"])), {}),
             ("bias + GELU split: PAIRED_STORES the other way", {}, dict(PAIRED_STORES=None)),
             ("FUSED_RESIDUAL the other way", {}, dict(FUSED_RESIDUAL=not qv.FUSED_RESIDUAL))]
    fast_ms = None
    for label, attention, tower_flags in flips:
        if left() < 4:
            print(f"{label}: skipped (budget)")
            continue
        places = {name: split_epilogues if name == "PAIRED_STORES" else qv for name in tower_flags}
        old = {name: getattr(places[name], name) for name in tower_flags}
        model.graph.close()
        knobs.set(**attention)
        for name, value in tower_flags.items():
            setattr(places[name], name, not old[name] if value is None else value)
        try:
            encode()
            ms_v, out = median_ms(encode, max(3, REPEATS // 2))
            if attention == dict(FAST):
                fast_ms, fast_out = ms_v, out
            same = all(np.array_equal(a, b) for a, b in zip(out, base))
            print(f"{label}: {ms_v:.1f} ms; {'bits equal' if same else 'max |diff| / max |default| ' + relative(out, base)}")
        except Exception as e:  # noqa: BLE001
            print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}")
        finally:
            knobs.reset()
            for name, value in old.items():
                setattr(places[name], name, value)
            model.graph.close()
    if left() > 8:
        best = dict(FAST) if fast_ms is not None and fast_ms < ms else {}
        knobs.set(**best)
        try:
            encode()
            print(f"GPU time by kernel ({'4 x 32 rows' if best else 'the default layout'}):")
            by_kernel(encode, 3)
        finally:
            knobs.reset()
            model.graph.close()
    if left() > 3:
        model.graph.enabled = False
        eager_ms, eager = median_ms(encode, 2)
        model.graph.enabled = True
        print(f"eager, median of 2: {eager_ms:.1f} ms; graph == eager: "
              f"{all(np.array_equal(a, b) for a, b in zip(base, eager))}")


def main() -> None:
    knobs = Knobs()
    for step in (attention_alone, gpu_tests, tower):
        if left() < 5:
            print(f"{step.__name__}: skipped (budget)")
            continue
        start = time.perf_counter()
        try:
            step(knobs)
        except Exception as e:  # noqa: BLE001
            print(f"{step.__name__} FAILED: {type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc(limit=3)
        print(f"({step.__name__}: {time.perf_counter() - start:.1f} s; {left():.0f} s left)")


if __name__ == "__main__":
    main()
