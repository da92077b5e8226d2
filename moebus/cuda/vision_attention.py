"""Non-causal multi-head attention over the patches of each image (the vision towers): rows
[n P, (n + 1) P) of q, k, v belong to image n and attend to each other only. No KV cache, no mask."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.compat import WARP, blocks, cuda, float32, threads, warp_max, warp_sum
from moebus.cuda.launch import ceil_div, require

WARPS = 4  # (row, head) pairs in flight per block
NEG_INF = float32(-np.inf)


def vision_attention_ref(q, k, v, num_images: int, scale: float) -> np.ndarray:
    # q, k, v (N P, H, hd) float32 -> (N P, H, hd) float32; N images of P positions each
    rows, heads, head_dim = q.shape
    shape = (num_images, rows // num_images, heads, head_dim)
    q, k, v = (np.asarray(a, np.float32).reshape(shape) for a in (q, k, v))
    scores = np.einsum("nphd,nqhd->nhpq", q, k).astype(np.float32) * np.float32(scale)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("nhpq,nqhd->nphd", probs, v).astype(np.float32).reshape(rows, heads, head_dim)


# -- cuda -----------------------------------------------------------------------------------------

@functools.cache
def _vision_attention_kernel(head_dim: int):
    @cuda.jit
    def attend(q, k, v, positions, scale, out):
        # one warp per (row, head); lane l takes keys l, l + 32, ... with its own running softmax
        # (max, sum, weighted values), then the lanes' partials are merged by warp reductions
        lane = cuda.threadIdx.x % WARP
        warps = cuda.blockDim.x // WARP
        first = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        stride = cuda.gridDim.x * warps
        rows, heads = q.shape[0], q.shape[1]
        q_row = cuda.local.array(head_dim, float32)
        acc = cuda.local.array(head_dim, float32)
        for start in range(0, rows * heads, stride):  # same trip count in every warp
            pair = min(start + first, rows * heads - 1)
            row, h = pair // heads, pair % heads
            base = (row // positions) * positions
            for d in range(head_dim):
                q_row[d] = q[row, h, d] * scale
                acc[d] = float32(0.0)
            running_max, running_sum = NEG_INF, float32(0.0)
            for j in range(lane, positions, WARP):
                score = float32(0.0)
                for d in range(head_dim):
                    score += q_row[d] * k[base + j, h, d]
                if score > running_max:
                    rescale = math.exp(running_max - score)
                    running_sum *= rescale
                    for d in range(head_dim):
                        acc[d] *= rescale
                    running_max = score
                p = math.exp(score - running_max)
                running_sum += p
                for d in range(head_dim):
                    acc[d] += p * v[base + j, h, d]
            top = warp_max(running_max)
            mine = math.exp(running_max - top) if running_max > NEG_INF else float32(0.0)
            total = warp_sum(running_sum * mine)
            for d in range(head_dim):
                value = warp_sum(acc[d] * mine)
                if lane == d % WARP and start + first < rows * heads:
                    out[row, h, d] = value / total

    return attend


def vision_attention_cuda(q, k, v, num_images: int, scale: float, out, stream=0):
    """out = vision_attention_ref(q, k, v, num_images, scale) on device arrays (N P, H, hd) float32."""
    require("q", q, np.float32, ndim=3)
    for name, array in (("k", k), ("v", v), ("out", out)):
        require(name, array, np.float32, shape=tuple(q.shape))
    rows, heads, head_dim = q.shape
    if num_images <= 0 or rows % num_images:
        raise ValueError(f"{rows} rows do not split into {num_images} images")
    if rows == 0:
        return out
    block = threads(WARPS * WARP)
    grid = blocks(ceil_div(rows * heads, block // WARP))
    _vision_attention_kernel(head_dim)[grid, block, stream](q, k, v, rows // num_images, np.float32(scale), out)
    return out
