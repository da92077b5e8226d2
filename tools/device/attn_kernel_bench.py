"""Decode attention alone at Qwen3-30B-A3B shapes (32 heads, 4 kv heads, hd 128): GPU time per call
and the KV bytes it reads per second, per KV dtype, batch and context; NMSE against attention_ref.
Runs on whichever moebus is first on PYTHONPATH (a tree with only float32 caches is timed with fp32),
so the same call can time the landed kernel beside a branch's.

    python tools/device/attn_kernel_bench.py [LABEL]"""
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
    return cuda.event_elapsed_time(start, end) * 1e3 / REPS


def case(kv_dtype: str, batch: int, context: int, rng, stream) -> dict:
    shape = (batch, KV_HEADS, context, HEAD_DIM)
    caches = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]
    if kv_dtype == "bf16":
        caches = [f32_to_bf16(c) for c in caches]
    q = rng.standard_normal((batch, HEADS, HEAD_DIM), dtype=np.float32)
    slots, positions = np.arange(batch, dtype=np.int32), np.full(batch, context - 1, np.int32)
    args = [cuda.to_device(a, stream=stream) for a in (q, *caches, slots, positions)]
    out = cuda.device_array(q.shape, np.float32, stream=stream)
    scratch = cuda.device_array(attention.attention_scratch_shape(batch, HEADS, HEAD_DIM, context), np.float32,
                                stream=stream)
    scale = HEAD_DIM ** -0.5
    us = time_us(lambda: attention.attention_cuda(*args, scale, 0, out, scratch, stream=stream), stream)
    ref = attention.attention_ref(q[:1], caches[0][:1], caches[1][:1], slots[:1], positions[:1], scale)
    got = out.copy_to_host()[:1]
    nmse = float(np.sum((got - ref) ** 2) / np.sum(ref ** 2))
    nbytes = 2 * batch * KV_HEADS * context * HEAD_DIM * caches[0].itemsize
    return {"kv_dtype": kv_dtype, "batch": batch, "context": context, "us": us, "gb_s": nbytes / us / 1e3,
            "nmse": nmse}


def main() -> None:
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
