"""Decode attention alone at Qwen3-30B-A3B shapes (32 heads, 4 kv heads, hd 128): GPU time per call
and the KV bytes it reads per second, per KV dtype, batch and context; NMSE against attention_ref.
Runs on whichever moebus is first on PYTHONPATH (a tree with only float32 caches is timed with fp32),
so the same call can time the landed kernel beside a branch's.

    python tools/device/attn_kernel_bench.py [LABEL]
    python tools/device/attn_kernel_bench.py --sweep   # this tree: heads per warp x rows ahead"""
from __future__ import annotations

import sys

import numpy as np

from moebus.cuda.kernels import attention
from moebus.cuda.kernels.compat import cuda
from moebus.cuda.dtypes import f32_to_bf16

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
CONTEXTS, BATCHES, REPS = (1024, 4096, 32768), (1, 8), 50


def time_us(run, stream) -> float:
    for _ in range(3):
        run()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(REPS):
        run()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / REPS


_INPUTS: dict = {}


def inputs(kv_dtype: str, batch: int, context: int, rng, stream) -> tuple:
    """(host arrays, device arrays) of one case, made once per process."""
    key = (kv_dtype, batch, context)
    if key not in _INPUTS:
        shape = (batch, KV_HEADS, context, HEAD_DIM)
        caches = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]
        if kv_dtype == "bf16":
            caches = [f32_to_bf16(c) for c in caches]
        q = rng.standard_normal((batch, HEADS, HEAD_DIM), dtype=np.float32)
        host = (q, *caches, np.arange(batch, dtype=np.int32), np.full(batch, context - 1, np.int32))
        _INPUTS[key] = host, [cuda.to_device(a, stream=stream) for a in host]
    return _INPUTS[key]


def case(kv_dtype: str, batch: int, context: int, rng, stream) -> dict:
    (q, k_cache, v_cache, slots, positions), args = inputs(kv_dtype, batch, context, rng, stream)
    out = cuda.device_array(q.shape, np.float32, stream=stream)
    scratch = cuda.device_array(attention.attention_scratch_shape(batch, HEADS, HEAD_DIM, context), np.float32,
                                stream=stream)
    scale = HEAD_DIM ** -0.5
    us = time_us(lambda: attention.attention_cuda(*args, scale, 0, out, scratch, stream=stream), stream)
    ref = attention.attention_ref(q[:1], k_cache[:1], v_cache[:1], slots[:1], positions[:1], scale)
    got = out.copy_to_host()[:1]
    nmse = float(np.sum((got - ref) ** 2) / np.sum(ref ** 2))
    nbytes = 2 * batch * KV_HEADS * context * HEAD_DIM * k_cache.itemsize
    return {"kv_dtype": kv_dtype, "batch": batch, "context": context, "us": us, "gb_s": nbytes / us / 1e3,
            "nmse": nmse}


def sweep(rng, stream) -> None:
    """The decode kernel's two tunables at the cases that matter (this tree only)."""
    from moebus.cuda.kernels import attention_decode as decode

    print(f"{'heads/warp':>10} {'ahead':>5} {'threads':>7}  bf16 b1 32k GB/s  bf16 b8 4k GB/s  fp32 b1 32k GB/s")
    for heads in (2, 4, 8):
        for ahead in (1, 2, 4):
            decode.MAX_HEADS_PER_WARP, decode.ROWS_AHEAD = heads, ahead
            threads = decode.decode_kernel("bf16", HEAD_DIM, HEADS // KV_HEADS)[1]
            runs = [case(*c, rng, stream) for c in (("bf16", 1, 32768), ("bf16", 8, 4096), ("fp32", 1, 32768))]
            print(f"{heads:>10} {ahead:>5} {threads:>7}  " + "  ".join(f"{r['gb_s']:>15.0f}" for r in runs)
                  + f"  worst nmse {max(r['nmse'] for r in runs):.1e}", flush=True)
    decode.MAX_HEADS_PER_WARP, decode.ROWS_AHEAD = 4, 2


def main() -> None:
    if sys.argv[1:] == ["--sweep"]:
        return sweep(np.random.default_rng(0), cuda.stream())
    label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
    dtypes = ("bf16", "fp32") if hasattr(attention, "KV_STORAGE") else ("fp32",)
    rng, stream = np.random.default_rng(0), cuda.stream()
    print(f"decode attention ({label}): {HEADS} heads, {KV_HEADS} kv heads, hd {HEAD_DIM}, {REPS} calls each")
    print(f"{'kv':>5} {'batch':>5} {'context':>7} {'us/call':>9} {'KV GB/s':>8} {'nmse':>9}")
    for kv_dtype in dtypes:
        for batch in BATCHES:
            for context in CONTEXTS:
                r = case(kv_dtype, batch, context, rng, stream)
                print(f"{r['kv_dtype']:>5} {r['batch']:>5} {r['context']:>7} {r['us']:>9.1f} {r['gb_s']:>8.0f} "
                      f"{r['nmse']:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
