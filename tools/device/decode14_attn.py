"""Decode attention alone at the 48 x 32 a3b model's shapes (32 heads, 4 kv heads, hd 128, bf16 cache),
as the decode graph runs it (one launch: the last split block merges, given counters), GPU time a call
from CUPTI (torch.profiler: the host's launch cost out of the figure, unlike attn_kernel_bench.py's
events around Python launches), per setting of attention_decode's constants. Each setting: us a call
at batch 1 of each context, the KV bytes' GB/s, NMSE of batch 1 against attention_ref.

    decode14_attn.py CALLS SETTING...    SETTING: "name:KEY=VALUE,KEY=VALUE" (KEY of attention_decode,
                                          e.g. "h8:MAX_HEADS_PER_WARP=8"; "base:" the defaults)
CALLS 0: each setting's kernels compiled (and run once) only, nothing timed (the warm phase).
CONTEXTS (env, "1024,4096,32768"), BATCH (env, 1)."""
import os
import sys

import numpy as np
from torch.profiler import ProfilerActivity, profile

from attn_kernel_bench import HEAD_DIM, HEADS, KV_HEADS, inputs
from decode13_bench import parse
from moebus.cuda.kernels import attention
from moebus.cuda.kernels import attention_decode as decode
from moebus.cuda.kernels.compat import cuda

CONTEXTS = [int(c) for c in os.environ.get("CONTEXTS", "1024,4096,32768").split(",")]
BATCH = int(os.environ.get("BATCH", "1"))
DEFAULTS = {k: getattr(decode, k) for k in dir(decode) if k.isupper()}


def run_case(context: int, calls: int, rng, stream) -> tuple[float, float]:
    """(GPU us a call, NMSE of token 0 against attention_ref) of the one-launch decode attention."""
    (q, k_cache, v_cache, slots, positions), args = inputs("bf16", BATCH, context, rng, stream)
    out = cuda.device_array(q.shape, np.float32, stream=stream)
    scratch = cuda.device_array(attention.attention_scratch_shape(BATCH, HEADS, HEAD_DIM, context), np.float32,
                                stream=stream)
    done = cuda.to_device(np.zeros(BATCH * KV_HEADS, np.int32), stream=stream)
    scale = HEAD_DIM ** -0.5
    call = lambda: attention.attention_cuda(*args, scale, 0, out, scratch, stream=stream, done=done)  # noqa: E731
    call()
    stream.synchronize()
    ref = attention.attention_ref(q[:1], k_cache[:1], v_cache[:1], slots[:1], positions[:1], scale)
    got = out.copy_to_host(stream=stream)[:1]
    nmse = float(np.sum((got - ref) ** 2) / np.sum(ref ** 2))
    if not calls:
        return 0.0, nmse
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        stream.synchronize()
    gpu_us = sum(e.device_time_total for e in prof.events()
                 if e.device_type.name == "CUDA" and "attention" in e.name and e.device_time_total > 0)
    return gpu_us / calls, nmse


def main() -> None:
    calls, settings = int(sys.argv[1]), sys.argv[2:]
    rng, stream = np.random.default_rng(0), cuda.stream()
    if calls:
        print(f"decode attention, {HEADS} heads / {KV_HEADS} kv heads / hd {HEAD_DIM}, bf16, batch {BATCH}, "
              f"one launch with merge, CUPTI GPU us a call ({calls} calls)")
        print(f"{'setting':<28}" + "".join(f"{c:>9} us {'GB/s':>6}" for c in CONTEXTS) + "  worst nmse")
    best = None  # (us at the longest context, setting) of the fastest setting with a good NMSE
    for setting in settings:
        name, _, items = setting.partition(":")
        for key, value in DEFAULTS.items():
            setattr(decode, key, value)
        for item in filter(None, items.split(",")):
            key, value = item.split("=", 1)
            setattr(decode, key, parse(value))
        try:
            cells, worst = "", 0.0
            for context in CONTEXTS:
                us, nmse = run_case(context, calls, rng, stream)
                nbytes = 2 * BATCH * KV_HEADS * context * HEAD_DIM * 2
                cells += f"{us:>12.1f} {nbytes / us / 1e3:>6.0f}" if calls else f"{'compiled':>19}"
                worst = max(worst, nmse)
            print(f"{name:<28}{cells}  {worst:.1e}" + ("  BAD" if not worst < 1e-4 else ""), flush=True)
            if calls and worst < 1e-4 and (best is None or us < best[0]):
                best = us, setting
                print(f"BEST {setting}", flush=True)  # so far (decode14.sh takes the last line)
        except Exception as e:  # noqa: BLE001 - one setting that fails (registers, shared memory) leaves the rest
            print(f"{name:<28} FAILED {type(e).__name__}: {str(e)[:150]}", flush=True)


if __name__ == "__main__":
    main()
