"""Issue 16, nineteenth session (branch mma19): the FP8 attention projections at batch 1, today's numba one-round
kernel (linear_quant_fp8.linear_fp8_one_round at its defaults) against linear_quant_mma's tensor-core kernel at the
shapes it sweeps. A3B's q|k|v (2,048 -> 5,120) and o (4,096 -> 2,048), launch i on layer i % LAYERS's weight (16
layers' worth, 168 + 134 MB, so that L2 holds none between its uses). Timing as mma18_bench.py: a spin kernel holds
the stream while the host queues REPEATS launches with an event between each two (no PDL: true durations), us a
launch (median, mean). Error: against the numba kernel's output, max abs and max relative to the largest |value|.

Then (--parts gate_up) the experts' fp8 gate|up as mma18_bench.py times it (A3B, 8 pairs, 16 layers' experts): the
default shape and (1, 8, 2, 3), each against numba's. (The first call also timed the layout's offsets compiled in,
FIXED_OFFSETS, removed after it: (1, 8, 2, 3) 11.58 against 11.74 us, (1, 4, 4, 4) 12.03, slower in the decode.)

    mma19_bench.py [--tiny] [--json PATH] [--parts dense,gate_up]   (--tiny: 256 -> 80 and 512 -> 48, 2 layers, 2
        launches; in the simulator only the numba kernels run, untimed)"""
import argparse
import sys
import time

import numpy as np

import mma18_bench
from mma18_bench import emit, error, spin_kernel, timed
from moebus.cuda.kernels import linear_quant_fp8, linear_quant_mma, moe_quant_mma
from moebus.cuda.kernels.compat import SIMULATOR, cuda
from moebus.cuda.kernels.launch import ceil_div
from moebus.cuda.kernels.quant_words import HARDWARE_E4M3_MIN_RUN, hardware_e4m3

PROJECTIONS = (("q|k|v", 2048, 5120), ("o", 4096, 2048))  # (name, inputs, outputs)


def weights(rows: int, cols: int, layers: int, rng):
    """[(codes, scales)] a layer on the device: random e4m3 codes without NaN, scales 2^-12 .. 2^-6 a row and 128."""
    sign = rng.integers(0, 2, (rows, cols), dtype=np.uint8) << 7
    codes = rng.integers(0, 0x7F, (rows, cols), dtype=np.uint8) | sign
    scales = (2.0 ** rng.uniform(-12, -6, (rows, ceil_div(cols, 128)))).astype(np.float32)
    return [(cuda.to_device(codes), cuda.to_device(scales)) for _ in range(layers)]  # the same bytes, other addresses


def bench(name: str, cols: int, rows: int, tiny: bool, log) -> list[dict]:
    layers, repeats = (2, 2) if tiny else (16, 200)
    rng = np.random.default_rng(19)
    began = time.perf_counter()
    per_layer = weights(rows, cols, layers, rng)
    stream = cuda.stream()
    x = cuda.to_device(rng.standard_normal((1, cols), dtype=np.float32), stream=stream)
    out_ref, out_mma = cuda.device_array((1, rows), np.float32), cuda.device_array((1, rows), np.float32)
    scratch = cuda.device_array(1, np.int32)
    spin, spin_rounds = spin_kernel(), (0 if SIMULATOR else 80000)
    hardware = hardware_e4m3(HARDWARE_E4M3_MIN_RUN)  # as linear_fp8_cuda

    def numba(layer):
        return lambda s: linear_quant_fp8.linear_fp8_one_round(x, *per_layer[layer], out_ref, s, hardware)

    def mma(layer, shape):
        return lambda s: linear_quant_mma.launch(x, *per_layer[layer], out_mma, s, shape, early=False)

    def run(kind, make, shape=None):
        warm = [make(layer) for layer in range(layers)]
        for launch in warm:
            launch(stream)
        stream.synchronize()
        median, mean = timed([warm[i % layers] for i in range(repeats)], stream, spin, scratch, spin_rounds)
        return {"kernel": f"{name} {kind}", "shape": shape, "us_median": round(median, 2), "us_mean": round(mean, 2)}

    emit({"section": "setup", "projection": name, "cols": cols, "rows": rows, "layers": layers, "repeats": repeats,
          "setup_s": round(time.perf_counter() - began, 1), "simulator": SIMULATOR}, log)
    found = [run("numba", numba)]
    numba(0)(stream)
    stream.synchronize()
    emit(found[0], log)
    if SIMULATOR:
        emit({"section": "skipped", "why": "NVRTC kernels run on a GPU only"}, log)
        return found
    for shape in linear_quant_mma.SWEEP.get(cols, (linear_quant_mma.shape_for(cols),)):
        try:
            row = run("mma", lambda layer: mma(layer, shape), list(shape))
            mma(0, shape)(stream)
            stream.synchronize()
            row.update(error(out_mma, out_ref))
        except Exception as e:  # noqa: BLE001 - one shape that fails leaves the others
            row = {"kernel": f"{name} mma", "shape": list(shape), "error": f"{type(e).__name__}: {e}"[:300]}
        emit(row, log)
        found.append(row)
    return found


def summary(rows) -> None:
    """A line a projection: the numba kernel's us a launch (median), each shape's and x numba, the largest error."""
    print("== mma19 summary (us a launch, median of 200, no L2 reuse, no PDL; shape us x numba; rel error vs numba)")
    for which in dict.fromkeys(r["kernel"].split()[0] for r in rows):
        mine = [r for r in rows if r["kernel"].split()[0] == which]
        base = next((r["us_median"] for r in mine if r["kernel"].endswith("numba")), None)
        parts = [f"{which} numba {base:.2f}:"]
        for r in mine:
            if r["kernel"].endswith("mma"):
                shape = "".join(map(str, r["shape"]))
                parts.append(f"{shape} FAILED" if "error" in r else
                             f"{shape} {r['us_median']:.2f} x{base / r['us_median']:.2f}")
        errors = [r["max_rel"] for r in mine if "max_rel" in r]
        print(" ".join(parts) + (f"; rel err <= {max(errors):.1e}" if errors else ""))
        for r in mine:
            if "error" in r:
                print(f"   {r['kernel']} {r['shape']}: {r['error'][:110]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--parts", default="dense,gate_up")
    args = parser.parse_args(argv)
    log = open(args.json, "w") if args.json else None
    parts = args.parts.split(",")
    if "dense" in parts:
        projections = (("q|k|v", 256, 80), ("o", 512, 48)) if args.tiny else PROJECTIONS
        rows = []
        for name, cols, out_rows in projections:
            rows += bench(name, cols, out_rows, args.tiny, log)
        summary(rows)
    if "gate_up" in parts:
        gate_up(args.tiny, log)
    return 0


def gate_up(tiny: bool, log) -> None:
    """mma18_bench's fp8 gate|up rows (no down): the default and (1, 8, 2, 3)."""
    mma18_bench.PAIRS = 2 if tiny else 8
    mma18_bench.DOWN_SHAPES = ()
    mma18_bench.GATE_UP_SHAPES = (moe_quant_mma.GATE_UP_SHAPE, (1, 8, 2, 3))
    found = mma18_bench.bench_format("fp8", tiny, log)
    mma18_bench.summary([r for r in found if "down" not in r["kernel"]])


if __name__ == "__main__":
    sys.exit(main())
