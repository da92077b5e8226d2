"""``moebus bench WHAT``: benchmarks that print figures (medians of repeated runs).

decode   tokens/s of the demo (or --model) model in-process and through broker + worker processes,
         and the broker's added latency per step; --pipeline both: 8 streams on a two-stage split,
         pipelined and not, beside one stage
decode-context  decode tok/s at 1k ... 32k positions of context, bf16 vs fp32 KV cache
prefill  tok/s and TFLOP/s of one prompt of 512 ... 8192 tokens in one step (--peer hf: transformers beside)
hop      the broker's step hop alone: STEP -> a real worker link -> STEP_REPLY round trips, no model
         (--broker DIR: through a real broker and client, PARTIAL intervals)
cache    routing traces (synthetic, recorded) replayed through each cache policy: hit rates per
         cache fraction
kernels  every cuda kernel against its numpy reference at realistic shapes (NMSE, time, GB/s)
vram     releasing and regrowing the elastic expert cache on a GPU, and copy-in bandwidth
soak     a serve under mixed load (cancels, VRAM resizes, bad requests) for minutes: RSS/VRAM per
         process over time, flat against a deliberately leaking negative control
vision-cycle  resident experts through one lazy-vision cycle, and the cold image request's time split
quality  quantized experts (--experts-dtype fp8,int4) against the bf16 model: top-1 agreement and mean
         KL over 256 decode steps of held-out prompts
"""
from __future__ import annotations


def run_bench(what: str, argv: list[str]) -> int:
    if what == "decode":
        from moebus.bench.decode import main
    elif what == "decode-context":
        from moebus.bench.decode_context import main
    elif what == "hop":
        from moebus.bench.hop import main
    elif what == "cache":
        from moebus.bench.cache import main
    elif what == "prefill":
        from moebus.bench.prefill import main
    elif what == "kernels":
        from moebus.bench.kernels import main
    elif what == "vram":
        from moebus.bench.vram import main
    elif what == "soak":
        from moebus.bench.soak import main
    elif what == "vision-cycle":
        from moebus.bench.vision_cycle import main
    elif what == "quality":
        from moebus.bench.quality import main
    else:
        print(__doc__)
        return 2
    return main(argv) or 0
