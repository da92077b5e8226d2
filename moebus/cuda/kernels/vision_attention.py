"""Non-causal multi-head attention over the patches of each image (the vision towers): rows
[n P, (n + 1) P) of q, k, v belong to image n and attend to each other only. No KV cache, no mask.

Three ways: ``vision_attention_cuda``, one kernel on CUDA cores (few rows, or no cuBLAS); on the
tensor cores (``image_attention_cuda``) the fused kernel (flash_attention.py: the keys and values
split once into bf16 planes, scratch from the backend's pool), or where it cannot run
prefill_attention.image_attention (materialised scores; the row softmax is
attention_parts.masked_softmax, unmasked: a warp per row)."""
from __future__ import annotations

import functools
import math

import numpy as np

from moebus.cuda.kernels.compat import SIMULATOR, WARP, blocks, cuda, float32, warp_max, warp_sum, kernel
from moebus.cuda.kernels.launch import ceil_div, require

WARPS = 2 if SIMULATOR else 8  # query rows per block, one per warp, sharing each key/value tile
MAX_HEAD_DIM = 128  # shared memory: 32 x (2 hd + 1) + WARPS x (hd + 32) floats = 38 KiB at 128
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
def _vision_attention_kernel(head_dim: int, warps: int):
    per_lane = (head_dim + WARP - 1) // WARP  # output dims each lane accumulates
    k_pitch = head_dim + 1  # odd pitch: lane j reading key j's element d hits bank (j + d) % 32

    @kernel
    def attend(q, k, v, positions, scale, out):
        # a block: one head, `warps` consecutive query rows of one image (one per warp); the
        # image's keys and values stream through shared memory in tiles of 32, and each warp keeps
        # a running softmax: lane j scores key j of the tile, lane l accumulates dims l, l + 32, ...
        k_tile = cuda.shared.array((WARP, k_pitch), float32)
        v_tile = cuda.shared.array((WARP, head_dim), float32)
        q_rows = cuda.shared.array((warps, head_dim), float32)
        p_rows = cuda.shared.array((warps, WARP), float32)
        acc = cuda.local.array(per_lane, float32)
        tid = cuda.threadIdx.x
        lane, w = tid % WARP, tid // WARP
        rows, heads = q.shape[0], q.shape[1]
        num_images = rows // positions
        groups = (positions + warps - 1) // warps
        for block in range(cuda.blockIdx.x, num_images * heads * groups, cuda.gridDim.x):
            image, rest = block // (heads * groups), block % (heads * groups)
            h, first = rest // groups, (rest % groups) * warps
            base = image * positions
            row = base + min(first + w, positions - 1)  # past the image's end: recompute its last row
            for d in range(lane, head_dim, WARP):
                q_rows[w, d] = q[row, h, d] * scale
            for i in range(per_lane):
                acc[i] = float32(0.0)
            running_max, running_sum = NEG_INF, float32(0.0)
            for key0 in range(0, positions, WARP):
                cuda.syncthreads()  # the previous tile (and the q rows' first use) are done with
                for e in range(tid, WARP * head_dim, warps * WARP):
                    j, d = e // head_dim, e % head_dim
                    is_key = key0 + j < positions
                    k_tile[j, d] = k[base + key0 + j, h, d] if is_key else float32(0.0)
                    v_tile[j, d] = v[base + key0 + j, h, d] if is_key else float32(0.0)
                cuda.syncthreads()
                score = float32(0.0)
                for d in range(head_dim):
                    score += q_rows[w, d] * k_tile[lane, d]
                if key0 + lane >= positions:
                    score = NEG_INF
                new_max = max(running_max, warp_max(score))
                shrink = math.exp(running_max - new_max)
                p = math.exp(score - new_max)
                running_sum = running_sum * shrink + warp_sum(p)
                running_max = new_max
                p_rows[w, lane] = p
                cuda.syncthreads()
                for i in range(per_lane):
                    d = min(lane + i * WARP, head_dim - 1)
                    total = acc[i] * shrink
                    for j in range(WARP):
                        total += p_rows[w, j] * v_tile[j, d]
                    acc[i] = total
            if first + w < positions:
                for i in range(per_lane):
                    d = lane + i * WARP
                    if d < head_dim:
                        out[row, h, d] = acc[i] / running_sum

    return attend


def image_rows(q, k, v, out, num_images: int) -> tuple[int, int, int]:
    """(rows, heads, head_dim) of image attention's (N P, H, hd) float32 q, k, v and out, checked to
    be alike and to split into ``num_images`` images (this kernel's and flash_attention's)."""
    require("q", q, np.float32, ndim=3)
    for name, array in (("k", k), ("v", v), ("out", out)):
        require(name, array, np.float32, shape=tuple(q.shape))
    rows, heads, head_dim = q.shape
    if num_images <= 0 or rows % num_images:
        raise ValueError(f"{rows} rows do not split into {num_images} images")
    return rows, heads, head_dim


def vision_attention_cuda(q, k, v, num_images: int, scale: float, out, stream=0):
    """out = vision_attention_ref(q, k, v, num_images, scale) on device arrays (N P, H, hd) float32."""
    rows, heads, head_dim = image_rows(q, k, v, out, num_images)
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} (the shared-memory tiles are sized for it)")
    if rows == 0:
        return out
    positions = rows // num_images
    groups = num_images * heads * ceil_div(positions, WARPS)
    kernel = _vision_attention_kernel(head_dim, WARPS)
    kernel[blocks(groups), WARPS * WARP, stream](q, k, v, positions, np.float32(scale), out)
    return out



def image_attention_cuda(ops, q, k, v, num_images: int, scale: float, out):
    """out = vision_attention_ref(q, k, v, num_images, scale) on the tensor cores of backend ``ops``:
    the fused kernel where it runs (split precision, a built kernel), its planes from ``ops.empty``
    (so a captured encode owns them), else the materialised path."""
    from moebus.cuda.kernels import flash_attention, prefill_attention

    rows, heads, head_dim = image_rows(q, k, v, out, num_images)
    if prefill_attention.PRECISION == "split" and flash_attention.ready(head_dim, True):
        shapes = flash_attention.plane_shapes(num_images, rows // num_images, heads, head_dim)
        planes = tuple(ops.empty(shape, np.uint16) for shape in shapes)
        return flash_attention.flash_images_cuda(q, k, v, num_images, scale, out, ops.stream, planes)
    return prefill_attention.image_attention(ops, ops.tensor_cores, q, k, v, num_images, scale, out)


def rope_attention_ready(tensor_cores, rows: int, head_dim: int, bias) -> bool:
    """Whether ``rope_image_attention_cuda`` runs for a tower's (rows, H, hd) q, k, v: the fused
    kernel's path of image_attention_cuda (tensor cores for these rows, split precision, the kernel
    built), an even head dim and a bf16 qkv bias."""
    from moebus.cuda.kernels import flash_attention, prefill_attention

    return (tensor_cores is not None and rows >= tensor_cores.min_rows and head_dim % 2 == 0
            and np.dtype(bias.dtype) == np.uint16 and prefill_attention.PRECISION == "split"
            and flash_attention.ready(head_dim, True))


def rope_image_attention_cuda(ops, q, k, v, bias, rope_pos, axes, cos, sin, num_images: int, scale: float, out):
    """out = vision_attention_ref(mrope(q + q's bias), mrope(k + k's bias), v + v's bias) on the
    tensor cores of backend ``ops`` (rope_attention_ready): the rotary, the biases and the split of
    the keys and values in one pass (flash_attention.rope_planes_cuda; q rotated into a temporary),
    then the fused kernel. q, k, v (N P, H, hd) float32, the qkv product's results without biases;
    bias (3 H hd,) bf16 bits; the rotary's arguments as mrope_ref's. ``out``: (N P, H, hd) float32,
    or (parts, N P, H hd) bf16 bits: the next product's split input (flash_planes_cuda)."""
    from moebus.cuda.kernels import flash_attention

    rows, heads, head_dim = image_rows(q, k, v, q, num_images)
    k_shape, v_shape = flash_attention.plane_shapes(num_images, rows // num_images, heads, head_dim)
    k_planes, v_planes, q_rotated = ops.empty(k_shape, np.uint16), ops.empty(v_shape, np.uint16), ops.empty(q.shape)
    flash_attention.rope_planes_cuda(q, k, v, bias, rope_pos, axes, cos, sin, num_images, q_rotated, k_planes, v_planes,
                                     ops.stream)
    return flash_attention.flash_planes_cuda(q_rotated, k_planes, v_planes, num_images, scale, out, ops.stream)
