"""The decode GEMVs' shapes of work, timed against each other at A3B decode sizes (median GPU us of
30 launches, bench kernels' timing): linear's (words a lane in flight, rows a warp) for qkv, o and
lm_head; the expert down kernel's (words, rows a warp) and gate|up's words in flight, 8 experts a
token of 32. The defaults in the code are marked *. Usage: decode_variants.py"""
import numpy as np

from moebus.bench.kernels import time_launches
from moebus.cuda.kernels import linear, moe_ffn
from moebus.cuda.kernels.compat import cuda

rng = np.random.default_rng(0)
stream = cuda.stream()


def bf16(*shape):
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def timed(run) -> float:
    return time_launches(run, 30, 3, stream)[0]


def linear_variants() -> None:
    default = linear.shape_for
    for name, rows, cols in (("qkv", 5120, 2048), ("o", 2048, 4096), ("lm_head", 151936, 2048)):
        w = cuda.to_device(bf16(rows, cols))
        for tokens in (1, 8):
            x = cuda.to_device(rng.standard_normal((tokens, cols), dtype=np.float32))
            out = cuda.device_array((tokens, rows), np.float32)
            cells = []
            for shape in ((4, 1), (8, 1), (2, 4), (4, 2), (2, 2)):
                linear.shape_for = lambda n, shape=shape: shape
                us = timed(lambda: linear.linear_cuda(x, w, out, stream=stream))
                mark = "*" if shape == default(tokens) else " "
                cells.append(f"{shape}{mark} {us:6.1f} us {w.nbytes / us / 1e3:5.0f} GB/s")
            linear.shape_for = default
            print(f"linear {name:<8} T={tokens}: " + " | ".join(cells), flush=True)


def expert_variants() -> None:
    hidden, inter, experts, top_k = 2048, 768, 32, 8
    arena = cuda.to_device(bf16(experts, 3 * hidden * inter))
    default_down, default_unroll = moe_ffn.down_shape, moe_ffn.MAX_UNROLL
    for tokens in (1, 8):
        chosen = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).ravel()
        order = np.argsort(chosen, kind="stable")
        tables = [cuda.to_device(a.astype(np.int32)) for a in (order // top_k, chosen[order], order)]
        x = cuda.to_device(rng.standard_normal((tokens, hidden), dtype=np.float32))
        out = cuda.device_array((tokens * top_k, hidden), np.float32)
        scratch = cuda.device_array((tokens * top_k, inter), np.float32)
        nbytes = len(np.unique(chosen)) * arena.shape[1] * 2
        cells = []
        for unroll in (4, 8):
            for down in ((6, 1), (6, 2), (2, 4), (3, 2), (2, 2)):
                moe_ffn.MAX_UNROLL = unroll
                moe_ffn.down_shape = lambda words, chunk, down=down: down
                us = timed(lambda: moe_ffn.expert_ffn_cuda(x, *tables, arena, hidden, inter, out, scratch,
                                                           stream=stream))
                moe_ffn.down_shape, moe_ffn.MAX_UNROLL = default_down, default_unroll
                mark = "*" if (unroll == default_unroll and down == default_down(inter // 4, min(tokens, 8))) else " "
                cells.append(f"g|u {unroll} down {down}{mark} {us:6.1f} us {nbytes / us / 1e3:5.0f} GB/s")
        print(f"expert_ffn T={tokens}:\n  " + "\n  ".join(cells), flush=True)


if __name__ == "__main__":
    for section in (linear_variants, expert_variants):
        try:
            section()
        except Exception as e:  # noqa: BLE001 - one section's failure leaves the other's figures
            print(f"{section.__name__} failed: {type(e).__name__}: {e}")
