"""An FP8 dense projection over a step of many rows (``tensor_cores.min_rows`` or more) on the tensor
cores, with a bounded scratch: the weight is dequantized to bf16 a slice of output rows at a time
(``linear_quant.fp8_to_bf16_cuda`` into one scratch of at most ``SLICE_BYTES``), and each slice's
product is written into its columns of the output. An FP8 lm_head (``lm_head.dtype`` fp8) is why:
dequantized whole it is a 622 MB scratch at a 151,936-token vocabulary and hidden 2,048, which would
undo what holding it in FP8 saves. The attention projections (at most ~20 MiB as bf16 in the A3B) fit
one slice, so they run as before: the whole weight dequantized once, one product.

Why slices on tensor cores and not the FP8 GEMV over token chunks (``linear_fp8_cuda``, which takes
any row count): the GEMV reads the whole FP8 weight once per ``linear_quant.MAX_TOKENS`` rows, so a
step of 64 sequences reads the lm_head's 311 MB 8 times (2.5 GB) and the logits of a 512-token
prompt 64 times (20 GB); the slices read it once, write and read each bf16 slice once (~1.2 GB more,
any row count) and leave the products to the tensor cores. ``SLICE_BYTES`` keeps a slice within the
H200's 50 MB L2, so the product may find the slice the dequantization just wrote there (to be timed).

Shapes: T rows (tokens), K inputs, N outputs (the weight's rows), S rows a slice."""
from __future__ import annotations

import os

import numpy as np

from moebus.cuda.kernels.gemm import address
from moebus.cuda.kernels.launch import require
from moebus.cuda.kernels.linear_quant import fp8_to_bf16_cuda

# the bf16 scratch one slice takes (MOEBUS_FP8_SLICE_MIB): 8,192 of the lm_head's rows at hidden 2,048
SLICE_BYTES = int(float(os.environ.get("MOEBUS_FP8_SLICE_MIB", "32")) * (1 << 20))


def slice_rows(num_out: int, dim_in: int, slice_bytes: int | None = None) -> int:
    """S: the weight rows a slice of ``slice_bytes`` (None: SLICE_BYTES) holds, at least one, at most
    all of them."""
    bound = SLICE_BYTES if slice_bytes is None else slice_bytes
    return max(1, min(num_out, bound // (2 * dim_in)))


def linear_fp8_sliced(ops, tc, x, weight, out):
    """out (T, N) float32 = x (T, K) float32 @ the FP8 ``weight`` (linear_quant.Fp8Weight) ^T on the
    tensor cores ``tc``, with one bf16 scratch of S x K (see the module doc). Every call runs on
    ``ops.stream``, so a slice's dequantization waits for the product before it to have read the
    scratch."""
    num_out, dim_in = weight.shape
    require("x", x, np.float32, shape=(None, dim_in))
    require("out", out, np.float32, shape=(x.shape[0], num_out))
    rows = slice_rows(num_out, dim_in)
    scratch = ops.empty((rows, dim_in), np.uint16)
    parts = tc.split(ops, x)  # once, for every slice
    for first in range(0, num_out, rows):
        count = min(rows, num_out - first)
        bf16 = fp8_to_bf16_cuda(weight.codes[first : first + count], weight.scales[first : first + count],
                                scratch[:count], stream=ops.stream)
        tc.matmul_nt(ops, parts, 0, x.shape[0], address(bf16), count, out, out_col=first)
    return out
