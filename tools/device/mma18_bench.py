"""Issue 16, eighteenth session (branch mma18): the fp8 expert GEMVs at batch 1, today's numba kernels
(moe_quant_round.kernels at their defaults) against moe_quant_mma's tensor-core kernels at the shapes it sweeps.
A3B shapes (D 2048, I 768), 8 pairs of distinct experts a launch, launch i on layer i % LAYERS's experts (16 layers'
worth: 128 resident experts, ~600 MB, so that L2 (50 MB) holds none of them between their uses). Timing: a spin
kernel holds the stream while the host queues REPEATS launches with an event between each two (cuda events, no
PDL: the true durations): us a launch, the median of REPEATS and the mean. Errors: gate|up's h and down's output
(fed numba's h) against the numba kernels', max abs and max relative to the largest |value|.

    mma18_bench.py [--tiny] [--json PATH] [--formats fp8,int4]   (--tiny: D 128, I 64, 2 pairs, 2 layers, 2
        launches; in the simulator only the numba kernels run, untimed). int4 the same way at its own shapes."""
import argparse
import json
import sys
import time

import numpy as np

from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.kernels import moe_quant_mma, moe_quant_round
from moebus.cuda.kernels.compat import SIMULATOR, WARP, blocks, cuda, threads
from moebus.cuda.kernels.launch import ceil_div
from moebus.cuda.kernels.moe_quant import round_hardware
from moebus.cuda.kernels.moe_ffn import WARPS

PAIRS = 8  # --tiny: 2
# (TILES, KSPLIT, WORDS, MIN_BLOCKS), the defaults first
GATE_UP_SHAPES, DOWN_SHAPES = moe_quant_mma.GATE_UP_SWEEP, moe_quant_mma.DOWN_SWEEP


def emit(row: dict, log) -> None:
    print(json.dumps(row), flush=True)
    if log:
        log.write(json.dumps(row) + "\n")
        log.flush()


def experts(layout, slots: int, rng):
    """(slots, B) uint8 on the device: PAIRS random blobs (fp8: codes without NaN, scales 2^-12 .. 2^-6; int4: any
    nibbles, the same scales, minimum -7.5 scale) repeated (the same bytes at other addresses: L2 holds by address)."""
    host = np.zeros((PAIRS, layout.blob_bytes), np.uint8)
    for blob in host:
        for codes, scales in layout.parts(blob):
            if layout.dtype == "fp8":
                codes[...] = rng.integers(0, 0x7F, codes.shape, dtype=np.uint8) | (
                    rng.integers(0, 2, codes.shape, dtype=np.uint8) << 7)
                scales[...] = 2.0 ** rng.uniform(-12, -6, scales.shape)
            else:
                codes[...] = rng.integers(0, 256, codes.shape, dtype=np.uint8)
                scales[..., 0] = 2.0 ** rng.uniform(-12, -6, scales.shape[:-1])
                scales[..., 1] = -7.5 * scales[..., 0]
    arena = cuda.device_array((slots, layout.blob_bytes), np.uint8)
    for first in range(0, slots, PAIRS):
        arena[first:first + PAIRS].copy_to_device(host[: min(PAIRS, slots - first)])
    return arena


def spin_kernel():
    """A one-thread kernel that holds the stream ~0.5-1.5 us a round (nanosleep may return early: 256 dependent
    multiply-adds a round besides), so that the host queues the timed launches behind it."""
    @cuda.jit
    def spin(out, rounds):
        acc = np.float32(1.0)
        for i in range(rounds):
            cuda.nanosleep(np.uint32(1000))  # the simulator has none: rounds 0 there
            for _ in range(256):
                acc = acc * np.float32(0.999999) + np.float32(1e-7)
        if acc == np.float32(-1.0):
            out[0] = 1
    return spin


def timed(launches, stream, spin, scratch, spin_rounds: int) -> tuple[float, float]:
    """(median, mean) us of the launches ([callable(stream)]), queued behind a spin kernel, an event between each."""
    spin[1, 1, stream](scratch, spin_rounds)
    events = [cuda.event() for _ in range(len(launches) + 1)]
    events[0].record(stream)
    for launch, event in zip(launches, events[1:]):
        launch(stream)
        event.record(stream)
    stream.synchronize()
    us = [a.elapsed_time(b) * 1e3 for a, b in zip(events, events[1:])]
    return float(np.median(us)), float(np.mean(us))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--formats", default="fp8,int4")
    args = parser.parse_args(argv)
    global PAIRS
    PAIRS = 2 if args.tiny else PAIRS
    log = open(args.json, "w") if args.json else None
    rows = []
    for fmt in args.formats.split(","):
        rows += bench_format(fmt, args.tiny, log)
    summary(rows)
    return 0


def bench_format(fmt: str, tiny: bool, log) -> list[dict]:
    """The numba kernels' rows, then (on a GPU) the tensor-core kernels' at the format's swept shapes."""
    hidden, inter, layers, repeats = (128, 64, 2, 2) if tiny else (2048, 768, 16, 200)
    rng = np.random.default_rng(18)
    layout = ExpertLayout(fmt, hidden, inter)
    began = time.perf_counter()
    arena = experts(layout, layers * PAIRS, rng)
    stream = cuda.stream()
    x = cuda.to_device(rng.standard_normal((1, hidden), dtype=np.float32), stream=stream)
    token, pair_out = (cuda.to_device(a, stream=stream)
                       for a in (np.zeros(PAIRS, np.int32), np.arange(PAIRS, dtype=np.int32)))
    slots = [cuda.to_device(np.arange(PAIRS, dtype=np.int32) + PAIRS * layer, stream=stream) for layer in range(layers)]
    h_ref, h_mma = (cuda.device_array((PAIRS, inter), np.float32) for _ in range(2))
    out_ref, out_mma = (cuda.device_array((PAIRS, hidden), np.float32) for _ in range(2))
    scratch = cuda.device_array(1, np.int32)
    spin, spin_rounds = spin_kernel(), (0 if SIMULATOR else 80000)  # 45-130 ms: the host queues 200 launches meanwhile

    offsets = layout.kernel_words()
    gate_w, up_w, down_w, gate_s, up_s, down_s = (*(n // 2 for n in offsets[:3]), *offsets[3:])
    blobs = (arena.view(np.uint64), arena.view(np.float32), arena.view(np.uint64), arena.view(np.float32))
    block = threads(WARPS * WARP)
    hardware = round_hardware()  # as expert_ffn_quant_cuda: the conversion instruction where the GPU has it
    gate_rows, _, down_rows, _ = moe_quant_round.shape(fmt, hardware)
    numba_gate_up, numba_down = moe_quant_round.kernels(hidden, inter, block, fmt, hardware)
    per_block = block // WARP
    x_words, h_words = x.view(np.uint64), h_ref.view(np.uint64)  # once: a view a launch costs host time

    def numba_gu(layer, h=h_ref):
        return lambda s: numba_gate_up[(blocks(ceil_div(ceil_div(inter, gate_rows), per_block)), PAIRS), block, s](
            x_words, token, slots[layer], *blobs, inter, gate_w, up_w, gate_s, up_s, 0, pair_out, h)

    def numba_dn(layer, out=out_ref):
        return lambda s: numba_down[(blocks(ceil_div(ceil_div(hidden, down_rows), per_block)), PAIRS), block, s](
            h_words, token, slots[layer], *blobs, hidden, down_w, down_w, down_s, down_s, 0, pair_out, out)

    def mma_gu(layer, shape, h=h_mma):
        return lambda s: moe_quant_mma.launch_gate_up(x, token, slots[layer], pair_out, arena, arena, layout, h, s,
                                                      shape)

    def mma_dn(layer, shape, out=out_mma):
        return lambda s: moe_quant_mma.launch_down(h_ref, token, slots[layer], pair_out, arena, arena, layout, out, s,
                                                   shape, early=False)

    def run(name, make, shape=None):
        warm = [make(layer) for layer in range(layers)]
        for launch in warm:  # compiles, then every layer's once
            launch(stream)
        stream.synchronize()
        median, mean = timed([warm[i % layers] for i in range(repeats)], stream, spin, scratch, spin_rounds)
        return {"kernel": f"{fmt} {name}", "shape": shape, "us_median": round(median, 2), "us_mean": round(mean, 2)}

    rows = []
    emit({"section": "setup", "format": fmt, "hidden": hidden, "inter": inter, "layers": layers, "repeats": repeats,
          "arena_mib": round(arena.nbytes / 2**20, 1), "setup_s": round(time.perf_counter() - began, 1),
          "numba_rows": [gate_rows, down_rows], "simulator": SIMULATOR}, log)
    rows.append(run("numba gate_up", numba_gu))
    numba_gu(0)(stream)  # layer 0's h, the reference of both downs
    rows.append(run("numba down", numba_dn))
    numba_dn(0)(stream)
    stream.synchronize()
    for row in rows:
        emit(row, log)
    if SIMULATOR:
        emit({"section": "skipped", "why": "NVRTC kernels run on a GPU only"}, log)
        return rows
    sweeps = (GATE_UP_SHAPES, DOWN_SHAPES) if fmt == "fp8" else (moe_quant_mma.INT4_GATE_UP_SWEEP,
                                                                 moe_quant_mma.INT4_DOWN_SWEEP)
    for name, make, shapes, got, ref in (("mma gate_up", mma_gu, sweeps[0], h_mma, h_ref),
                                         ("mma down", mma_dn, sweeps[1], out_mma, out_ref)):
        for shape in shapes:
            try:
                row = run(name, lambda layer: make(layer, shape), list(shape))
                make(0, shape)(stream)
                stream.synchronize()
                row.update(error(got, ref))
            except Exception as e:  # noqa: BLE001 - one shape that fails leaves the others
                row = {"kernel": f"{fmt} {name}", "shape": list(shape), "error": f"{type(e).__name__}: {e}"[:300]}
            emit(row, log)
            rows.append(row)
    return rows


def error(got, ref) -> dict:
    """A kernel's output against the numba kernel's (device arrays): max abs, max relative to the largest |ref|."""
    got, ref = got.copy_to_host(), ref.copy_to_host()
    scale = float(np.abs(ref).max()) or 1.0
    return {"max_abs": float(np.abs(got - ref).max()), "max_rel": float(np.abs(got - ref).max() / scale),
            "finite": bool(np.isfinite(got).all())}


def summary(rows) -> None:
    """One line a row: us a launch (median, mean), x the numba kernel's median, the error against its output."""
    base = {(r["kernel"].split()[0], r["kernel"].split()[2]): r.get("us_median") for r in rows
            if r["kernel"].split()[1] == "numba"}
    print(f"== mma18 summary (us a launch, median of 200; {PAIRS} pairs, no L2 reuse; x numba; error vs numba)")
    for r in rows:
        fmt, kind, which = r["kernel"].split()
        if "error" in r:
            print(f"{r['kernel']:18s} {r.get('shape')}: FAILED {r['error'][:100]}")
            continue
        ratio = f" x{base[fmt, which] / r['us_median']:.2f}" if kind == "mma" and base.get((fmt, which)) else ""
        err = f" err abs {r['max_abs']:.1e} rel {r['max_rel']:.1e}" if "max_rel" in r else ""
        print(f"{r['kernel']:18s} {str(r.get('shape') or ''):13s} {r['us_median']:6.2f} us "
              f"(mean {r['us_mean']:.2f}){ratio}{err}")


if __name__ == "__main__":
    sys.exit(main())
