"""The tensor-core decode attention (attention_decode_tc.py, an experiment) at the 48 x 32 a3b model's
shapes (32 heads, 4 kv heads, hd 128, bf16 cache), b1: CUPTI GPU us a call of its split kernel and of the
merge apart (attention_decode.merge_splits), at 1k / 4k / 32k, per setting; the KV bytes' GB/s of the two
together; NMSE against attention_ref (decode14_attn.py's inputs and CUPTI use).

    decode15_tc.py CALLS SETTING...    SETTING: "name:DECODE_SPLITS,SPLIT_POSITIONS,WARPS,MIN_BLOCKS"
CALLS 0: each setting compiled and run once (NMSE only). CONTEXTS (env, "1024,4096,32768")."""
import os
import sys

import numpy as np
from torch.profiler import ProfilerActivity, profile

from attn_kernel_bench import HEAD_DIM, HEADS, KV_HEADS, inputs
from moebus.cuda.kernels import attention, attention_decode_tc
from moebus.cuda.kernels import attention_decode as decode
from moebus.cuda.kernels.compat import cuda

CONTEXTS = [int(c) for c in os.environ.get("CONTEXTS", "1024,4096,32768").split(",")]


def run_case(context: int, calls: int, setting: tuple, rng, stream) -> tuple:
    """(split us, merge us, NMSE of the output against attention_ref) at batch 1."""
    splits, positions, warps, min_blocks = setting
    decode.DECODE_SPLITS, decode.SPLIT_POSITIONS = splits, positions  # the scratch's and the merge's
    (q, k_cache, v_cache, slots, pos), (dq, dk, dv, dslots, dpos) = inputs("bf16", 1, context, rng, stream)
    out = cuda.device_array(q.shape, np.float32, stream=stream)
    scratch = cuda.device_array(attention.attention_scratch_shape(1, HEADS, HEAD_DIM, context), np.float32,
                                stream=stream)
    merge = decode.merge_splits(HEAD_DIM)
    scale = HEAD_DIM ** -0.5

    def call():
        attention_decode_tc.launch(dq, dk, dv, dslots, dpos, scale, scratch, stream, splits, positions, warps,
                                   min_blocks)
        merge[(1, HEADS), decode.MERGE_THREADS, stream](dpos, 0, scratch, out)

    call()
    stream.synchronize()
    ref = attention.attention_ref(q, k_cache, v_cache, slots, pos, scale)
    got = out.copy_to_host(stream=stream)
    nmse = float(np.sum((got - ref) ** 2) / np.sum(ref ** 2))
    if not calls:
        return 0.0, 0.0, nmse
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        stream.synchronize()
    split_us = merge_us = 0.0
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            if "decode_attention_tc" in e.name:
                split_us += e.device_time_total / calls
            elif "merge" in e.name:
                merge_us += e.device_time_total / calls
    return split_us, merge_us, nmse


def main() -> None:
    calls, settings = int(sys.argv[1]), sys.argv[2:]
    rng, stream = np.random.default_rng(0), cuda.stream()
    defaults = decode.DECODE_SPLITS, decode.SPLIT_POSITIONS
    print(f"tensor-core decode attention, {HEADS} heads / {KV_HEADS} kv heads / hd {HEAD_DIM}, bf16, b1, split kernel "
          f"+ merge apart, CUPTI GPU us a call ({calls} calls)")
    print(f"{'setting':<24}" + "".join(f"{c:>7} split+merge = us  GB/s" for c in CONTEXTS) + "  worst nmse")
    for item in settings:
        name, _, values = item.partition(":")
        try:
            setting = tuple(int(v) for v in values.split(","))
            cells, worst = "", 0.0
            for context in CONTEXTS:
                split_us, merge_us, nmse = run_case(context, calls, setting, rng, stream)
                total = split_us + merge_us
                nbytes = 2 * KV_HEADS * context * HEAD_DIM * 2
                cells += (f"{split_us:>13.1f}+{merge_us:<4.1f}={total:>5.1f} {nbytes / total / 1e3:>5.0f}" if calls
                          else f"{'compiled':>31}")
                worst = max(worst, nmse)
            print(f"tc {name:<21}{cells}  {worst:.1e}" + ("  BAD" if not worst < 1e-4 else ""), flush=True)
        except Exception as e:  # noqa: BLE001 - one setting that fails leaves the rest
            print(f"tc {name:<21} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        finally:
            decode.DECODE_SPLITS, decode.SPLIT_POSITIONS = defaults


if __name__ == "__main__":
    main()
