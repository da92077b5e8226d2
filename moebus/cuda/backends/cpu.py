"""The cpu backend (and the contract every backend keeps): the ops that a stage calls, on numpy (``cpu``) or numba.cuda (``cuda``).

Both take and return their own array type (numpy arrays / device arrays); the stage only moves data
across with ``upload`` / ``persist`` and ``to_host``. Every op's result is per-step scratch: valid
until the next ``begin_step()``, so a backend can recycle buffers instead of allocating per call. Weights are prepared once at load with ``weight``; the
``cpu`` backend keeps dense weights as float32 copies (numpy has no bf16 matmul, and converting per
call would dominate a CPU decode step) while experts stay in their stored dtype in the arena."""
from __future__ import annotations

import numpy as np

from moebus.cuda.dtypes import to_f32
from moebus.cuda.kernels import (attention, elementwise, embedding, fused, linear, moe, penalties, rmsnorm, rope,
                                 routing, sampling, top_logprobs)
from moebus.cuda.kernels import activations, layernorm, scatter, tiled_linear, vision_attention  # the vision tower's ops
from moebus.cuda.kernels import attention_chunk  # a routed step's chunk beside decode rows
from moebus.cuda.kernels import attention_chunk_tc  # its rows a tile
from moebus.cuda.kernels import mrope, weighted_rows  # Qwen3-VL: M-RoPE, the tower's 2-D rotary and positions
from moebus.cuda.kernels import patchify  # Qwen3-VL: an image's patches from its bytes
from moebus.cuda.kernels import split_epilogues  # the towers' products' inputs (split on cuda)
from moebus.cuda.kernels import moe_quant  # quantized experts
from moebus.cuda.kernels import rope_attention  # decode's qkv_rope_store + attention (one kernel on cuda)
from moebus.cuda.kernels.linear_quant import fp8_rows_dequantize  # FP8 attention projections
from moebus.cuda.kernels.norm_route import norm_route_ref  # decode's MLP entry


class CpuBackend:
    """The numpy reference of every op, as the ``cpu`` device."""

    name = "cpu"

    def begin_step(self) -> None:
        """Start of a forward pass: per-step buffers of the previous step may be reused."""

    def layer_mark(self) -> int:
        """numpy frees a layer's temporaries itself once nothing refers to them."""
        return 0

    def recycle_layer(self, mark: int, keep) -> None:
        pass

    def weight(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(to_f32(array))

    def fp8_weight(self, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """An FP8 dense weight (common/fp8_dense.py) dequantized to float32: the FP8 GEMV's reference."""
        return np.ascontiguousarray(fp8_rows_dequantize(codes, scales))

    def table(self, array: np.ndarray) -> np.ndarray:
        """A weight read by row (embedding), kept in its stored dtype."""
        return np.asarray(array)

    def token_table(self, array: np.ndarray) -> np.ndarray:
        """The token embedding: the cpu device's memory is the host's (the emulated GPU is not
        charged for it: memory/host_table.py)."""
        return np.asarray(array)

    def persist(self, array: np.ndarray) -> np.ndarray:
        """A device copy that lives as long as its owner (rope tables, an arena)."""
        return np.ascontiguousarray(array)

    def upload(self, array: np.ndarray) -> np.ndarray:
        """A per-step input, valid until the next begin_step()."""
        return np.ascontiguousarray(array)

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    def overwrite(self, target: np.ndarray, host: np.ndarray) -> None:
        """Copy ``host`` into the persistent array ``target``."""
        np.copyto(target, host)

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        """A persistent zeroed buffer (KV cache)."""
        return np.zeros(shape, dtype=dtype)

    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        """Per-step scratch, valid until the next begin_step()."""
        return np.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        pass

    def release_scratch(self) -> int:
        """Nothing pooled: a step's scratch is numpy's, freed as it goes."""
        return 0

    def borrow(self, region) -> None:
        """Scratch from lent arena memory: activations are host memory here, so nothing to do."""

    def end_borrow(self) -> None:
        pass

    embedding = staticmethod(embedding.embedding_ref)
    rmsnorm = staticmethod(rmsnorm.rmsnorm_ref)
    add_rmsnorm = staticmethod(fused.add_rmsnorm_ref)
    combine_add_rmsnorm = staticmethod(fused.combine_add_rmsnorm_ref)

    @staticmethod
    def qkv_rope_store(qkv, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, token_slot,
                       token_pos, cos, sin, k_cache, v_cache):
        return fused.qkv_rope_store_ref(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, token_slot,
                                        token_pos, cos, sin, k_cache, v_cache)

    def linear_qkv_rope_store(self, h, weight, *rest):
        """qkv_rope_store(linear(h, weight), *rest) (one launch on cuda: qkv_gemv.py)."""
        return self.qkv_rope_store(self.linear(h, weight), *rest)

    @staticmethod
    def takes_rope_attention(num_heads: int, q_weight, k_weight, cos, k_cache, window: int) -> bool:
        """The stage's rope_attention path is for the cuda kernel: here qkv_rope_store then attention."""
        return False

    @staticmethod
    def rope_attention(qkv, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, token_slot, token_pos,
                       cos, sin, k_cache, v_cache, scale: float, window: int = 0):
        return rope_attention.rope_attention_ref(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, token_slot,
                                                 token_pos, cos, sin, k_cache, v_cache, scale, window)
    linear = staticmethod(linear.linear_ref)
    add = staticmethod(elementwise.add_ref)
    swiglu = staticmethod(elementwise.swiglu_ref)
    rope = staticmethod(rope.rope_ref)
    kv_store = staticmethod(attention.kv_store_ref)

    @staticmethod
    def attention(q, k_cache, v_cache, token_slot, token_pos, scale: float, window: int = 0, segments=None,
                  tiles=None):
        """``segments`` (the step's sequences, for a backend's prefill path): the reference needs none;
        ``tiles``: a routed step's tile table (attention_chunk.py): checked; the reference's sums are
        those of a step without one (the cpu device's results do not depend on the setting)."""
        if tiles is not None:
            max_rows = attention_chunk_tc.tile_rows(q.shape[1] // k_cache.shape[1])
            attention_chunk.check_tiles(tiles, token_slot, token_pos, max_rows)
        return attention.attention_ref(q, k_cache, v_cache, token_slot, token_pos, scale, window)

    @staticmethod
    def topk_softmax(logits, top_k: int, normalize: bool, ids=None):
        chosen, weights = moe.topk_softmax_ref(logits, top_k, normalize)
        if ids is None:
            return chosen, weights
        ids[...] = chosen
        return ids, weights

    route_pairs = staticmethod(routing.route_pairs_ref)

    @staticmethod
    def routes_experts(*_) -> bool:
        """Never here: on cuda the gate|up GEMV may end the routing (CudaBackend.linear_route_experts)."""
        return False

    @staticmethod
    def combines_experts(*_, **__) -> bool:
        """Never here: on cuda the down GEMV may end in the combine (CudaBackend.expert_ffn_combine)."""
        return False

    def linear_normed(self, x, square, norm_weight, eps: float, weight):
        """linear(rmsnorm(x, norm_weight), weight); ``square`` (the tiles' sums of x^2, cuda's) is not needed here."""
        return self.linear(self.rmsnorm(x, norm_weight, eps), weight)

    def linear_norm_route(self, a, weight, x, *rest):
        """norm_route(x, linear(a, weight), *rest) (on cuda the projection may start the routing: linear_quant_mma)."""
        return self.norm_route(x, self.linear(a, weight), *rest)

    @staticmethod
    def norm_route(x, y, norm_weight, eps: float, router, top_k: int, normalize: bool, table, layer_row: int, ids):
        out = norm_route_ref(x, y, norm_weight, eps, router, top_k, normalize, table, layer_row)
        ids[...] = out[2]
        return out[:2] + (ids,) + out[3:]

    @staticmethod
    def expert_ffn(x, pair_token, pair_slot, pair_out, arena, hidden: int, inter: int, out, store=None, layout=None):
        """``layout``: the experts' quantized layout (common/quant_layout.py); None for bf16 blobs."""
        if layout is not None:
            return moe_quant.expert_ffn_quant_ref(x, pair_token, pair_slot, pair_out, arena, layout, out, store=store)
        return moe.expert_ffn_ref(x, pair_token, pair_slot, pair_out, arena, hidden, inter, out, store=store)
    combine = staticmethod(moe.combine_ref)
    sample = staticmethod(sampling.sample_ref)
    top_logprobs = staticmethod(top_logprobs.top_logprobs_rows_ref)
    # vision tower and stage-0 image embeddings
    layernorm = staticmethod(layernorm.layernorm_ref)
    bias_activation = staticmethod(tiled_linear.bias_activation_ref)  # before the module's name is taken
    bias_residual = staticmethod(tiled_linear.bias_residual_ref)
    tiled_linear = staticmethod(tiled_linear.tiled_linear_ref)
    layernorm_into = staticmethod(split_epilogues.layernorm_into_ref)  # float32 here: products read it
    bias_activation_into = staticmethod(split_epilogues.bias_activation_into_ref)
    tiled_linears = staticmethod(split_epilogues.tiled_linears_ref)
    activation = staticmethod(activations.activation_ref)
    add_bias = staticmethod(activations.add_bias_ref)
    vision_attention = staticmethod(vision_attention.vision_attention_ref)
    scatter_rows = staticmethod(scatter.scatter_rows_ref)
    apply_rules = staticmethod(penalties.apply_rules_ref)
    token_logprobs = staticmethod(penalties.token_logprobs_ref)
    # Qwen3-VL (cuda/kernels/mrope.py, weighted_rows.py)
    mrope = staticmethod(mrope.mrope_ref)
    weighted_rows = staticmethod(weighted_rows.weighted_rows_ref)
    pixel_patches = staticmethod(patchify.pixel_patches_ref)
