"""The decode GEMVs' work shapes that sit behind constants, timed against each other at A3B decode
sizes (median GPU us of 30 launches, bench kernels' timing), the weights rotated over copies of
>= 256 MB so that no call finds them in the 50 MB L2 (decode_variants.py timed one copy: qkv and o
fit in L2). Writes the fastest value of each constant to CHOICES (JSON), weighing a step's use: 48
layers of qkv + o beside one lm_head; the experts' whole FFN. Usage: decode6_variants.py CHOICES"""
import itertools
import json
import sys

import numpy as np

from moebus.bench.kernels import time_launches
from moebus.cuda.kernels import linear, moe_ffn
from moebus.cuda.kernels.compat import cuda

rng = np.random.default_rng(0)
stream = cuda.stream()
LAYERS = 48
ROTATE_BYTES = 256 << 20


def bf16(*shape):
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def timed(run) -> float:
    return time_launches(run, 30, 3, stream)[0]


def set_constants(module, values: dict) -> dict:
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    return before


def linear_sweep(name: str, values, tokens: int) -> dict:
    """{value: weighted us per step} of linear.<name> at this many tokens."""
    totals = {}
    for rows, cols, weight in ((5120, 2048, LAYERS), (2048, 4096, LAYERS), (151936, 2048, 1)):
        copies = max(1, -(-ROTATE_BYTES // (rows * cols * 2)))
        ws = [cuda.to_device(bf16(rows, cols)) for _ in range(copies)]
        x = cuda.to_device(rng.standard_normal((tokens, cols), dtype=np.float32))
        out = cuda.device_array((tokens, rows), np.float32)
        cells = []
        for value in values:
            before = set_constants(linear, {name: value})
            it = itertools.cycle(ws)
            us = timed(lambda: linear.linear_cuda(x, next(it), out, stream=stream))
            set_constants(linear, before)
            totals[value] = totals.get(value, 0.0) + weight * us
            cells.append(f"{name}={value}{'*' if value == before[name] else ' '} {us:7.1f} us "
                         f"{rows * cols * 2 / us / 1e3:5.0f} GB/s")
        print(f"linear {rows}x{cols} T={tokens}: " + " | ".join(cells), flush=True)
    return totals


def expert_sweep(settings: list[dict], tokens: int) -> list[float]:
    """us of the whole expert FFN (gate|up + down) of 8 experts a token of 32, per setting."""
    hidden, inter, experts, top_k = 2048, 768, 32, 8
    arena = cuda.to_device(bf16(experts, 3 * hidden * inter))
    tables, nbytes = [], []
    for _ in range(4):  # four draws: the 32 experts' 302 MB rotate through L2
        chosen = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).ravel()
        order = np.argsort(chosen, kind="stable")
        tables.append([cuda.to_device(a.astype(np.int32)) for a in (order // top_k, chosen[order], order)])
        nbytes.append(len(np.unique(chosen)) * arena.shape[1] * 2)
    x = cuda.to_device(rng.standard_normal((tokens, hidden), dtype=np.float32))
    out = cuda.device_array((tokens * top_k, hidden), np.float32)
    scratch = cuda.device_array((tokens * top_k, inter), np.float32)
    times = []
    for setting in settings:
        before = set_constants(moe_ffn, setting)
        it = itertools.cycle(tables)
        us = timed(lambda: moe_ffn.expert_ffn_cuda(x, *next(it), arena, hidden, inter, out, scratch, stream=stream))
        set_constants(moe_ffn, before)
        times.append(us)
        print(f"expert_ffn T={tokens} {setting}: {us:7.1f} us {np.mean(nbytes) / us / 1e3:5.0f} GB/s", flush=True)
    return times


def main() -> None:
    choices = {}
    for name, values, tokens in (("MAX_UNROLL", (4, 8, 16), 1), ("ROWS_PER_WARP", (1, 2, 4), 8)):
        totals = linear_sweep(name, values, tokens)
        choices[f"linear.{name}"] = min(totals, key=totals.get)
    short = [{"MAX_UNROLL": u, "DOWN_ROWS_SHORT": d} for u in (8, 16) for d in (1, 2)]
    times = expert_sweep(short, 1)
    choices.update({f"moe_ffn.{k}": v for k, v in short[int(np.argmin(times))].items()})
    long = [{"DOWN_ROWS_LONG": d} for d in (1, 2, 4)]
    times = expert_sweep(long, 8)
    choices.update({f"moe_ffn.{k}": v for k, v in long[int(np.argmin(times))].items()})
    print("CHOICES", json.dumps(choices), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(choices, f)


if __name__ == "__main__":
    main()
