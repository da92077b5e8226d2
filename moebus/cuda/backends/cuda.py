"""The ``cuda`` device: the stage's ops as numba.cuda kernels, all on one stream, with no host round
trip except ``to_host``. Same interface and return conventions as ``CpuBackend`` (backend.py).

Per-step buffers (op results, ``empty``, ``upload``) come from pools that ``begin_step()`` recycles,
so a steady decode loop allocates nothing; persistent arrays (``weight``, ``table``, ``persist``,
``zeros``) are plain device allocations owned by the caller; ``token_table`` (the token embedding)
is pinned host memory mapped into the device."""
from __future__ import annotations

import numpy as np

from moebus.cuda.kernels import (attention, elementwise, embedding, fused, linear, moe, moe_ffn, rmsnorm,
                                 rope, routing, sampling, top_logprobs)
from moebus.cuda.kernels import penalties, prefill_attention
from moebus.cuda.kernels import attention_chunk  # a routed step's chunk beside decode rows
from moebus.cuda.kernels.norm_route import norm_route_cuda, route_tail_cuda  # decode's MLP entry
from moebus.cuda.kernels.compat import SIMULATOR, cuda
from moebus.cuda.kernels.gemm import make_tensor_cores
from moebus.cuda.backends.graphs import swapped
from moebus.cuda.memory.context_limits import lower_stack_limit
from moebus.cuda.memory.host_table import device_view, embedding_in_vram, mapped_empty, mapped_table
from moebus.cuda.memory.step_pool import StepPool

ATTENTION_COUNTERS = 1024  # (token, kv head) pairs a decode attention launch merges in its split kernel
from moebus.cuda.kernels import activations, layernorm, scatter, tiled_linear, vision_attention  # the vision tower's ops
from moebus.cuda.kernels import mrope, weighted_rows  # Qwen3-VL: M-RoPE, the tower's 2-D rotary and positions
from moebus.cuda.kernels import patchify  # Qwen3-VL: an image's patches from its bytes
from moebus.cuda.kernels import split_epilogues  # the towers' products' inputs, split where they are made
from moebus.cuda.kernels import moe_quant, moe_quant_mma  # quantized experts (and their GEMVs on tensor cores)
from moebus.cuda.kernels import linear_quant, linear_quant_mma  # FP8 attention projections and lm_head (*.dtype fp8)
from moebus.cuda.kernels import linear_quant_slices  # ... of long steps on tensor cores, a bounded slice at a time
from moebus.cuda.kernels import route_end  # the routing's end after the ROUTE entry (CUDA C, route_tail's bits)
from moebus.cuda.kernels import rope_attention  # decode's qkv_rope_store as the attention's prologue
from moebus.cuda.kernels import qkv_gemv  # decode's q|k|v projection with qkv_rope_store as its tail (opt-in)


class CudaBackend(split_epilogues.SplitInputOps):
    """numba.cuda kernels on the current device (the towers' split-input ops: split_epilogues.py)."""

    name = "cuda"

    def __init__(self, stack_bytes: int | None = None):
        """``stack_bytes``: the context's stack limit where MOEBUS_CUDA_STACK_BYTES is unset (None: the
        driver's; memory/context_limits.py)."""
        if not SIMULATOR:  # the context is made here: its stack limit before any kernel
            cuda.current_context()
            lower_stack_limit(default=stack_bytes)
        self.stream = cuda.stream()  # also the compute stream that the expert copier fences against
        self.device_pool = StepPool(lambda shape, dtype: cuda.device_array(shape, dtype=dtype))
        # uploads go through pinned staging so the copy is truly async; kept until the next step
        self.staging_pool = StepPool(lambda shape, dtype: cuda.pinned_array(shape, dtype=dtype))
        self.tensor_cores = make_tensor_cores()  # cuBLAS for steps of many tokens (None: GEMVs only)
        self.route_done = cuda.to_device(np.zeros(1, np.int32), stream=self.stream)  # norm_route's counter
        # decode attention's counters, one a (token, kv head): the last split block merges
        self.attention_done = cuda.to_device(np.zeros(ATTENTION_COUNTERS, np.int32), stream=self.stream)
        self.qkv_done = cuda.to_device(np.zeros(qkv_gemv.MAX_HEADS, np.int32), stream=self.stream)  # a head's blocks

    # -- memory -----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start of a forward pass: per-step buffers of the previous step may be reused."""
        self.stream.synchronize()  # the previous step's kernels and copies no longer touch them
        self.device_pool.recycle()
        self.staging_pool.recycle()

    def release_scratch(self) -> int:
        """Give the step pool's idle buffers back to the driver now: after the stream's work, with
        numba's deferred frees flushed, so the free VRAM read next counts them. The last step's own
        buffers stay (they are valid until the next begin_step()). Returns the bytes dropped."""
        self.stream.synchronize()
        before = self.device_pool.allocated_bytes
        self.device_pool.release()
        context = cuda.current_context()
        if hasattr(context, "deallocations"):  # not in the simulator
            context.deallocations.clear()
        return before - self.device_pool.allocated_bytes

    def layer_mark(self) -> int:
        """Before the first layer: the point that recycle_layer() gives buffers back to."""
        return self.device_pool.mark()

    def recycle_layer(self, mark: int, keep) -> None:
        """After a layer: its temporaries serve the next layer (same stream, so in order); staging
        buffers are not reused within a step, the host may still be copying out of them."""
        self.device_pool.recycle_since(mark, keep)

    def weight(self, array: np.ndarray):
        """Dense weights stay in their stored dtype (bf16 bits, f16, f32); kernels convert in registers."""
        return cuda.to_device(np.ascontiguousarray(array), stream=self.stream)

    def fp8_weight(self, codes: np.ndarray, scales: np.ndarray):
        """An FP8 dense weight (common/fp8_dense.py) as the FP8 GEMV reads it (linear_quant.py)."""
        return linear_quant.Fp8Weight(self.weight(codes), self.weight(scales))

    def table(self, array: np.ndarray):
        """A weight read by row (the vision tower's position table), kept in its stored dtype."""
        return self.weight(array)

    def token_table(self, array: np.ndarray):
        """The token embedding, kept in its stored dtype: in mapped host memory, where the gather
        reads only its tokens' rows over PCIe, and the VRAM it would take goes to the expert cache
        (memory/host_table.py). ``MOEBUS_EMBEDDING_VRAM=1``: a device copy instead."""
        return self.weight(array) if embedding_in_vram() else mapped_table(array)

    def persist(self, array: np.ndarray):
        """A device copy that lives as long as its owner (rope tables, an arena)."""
        return self.weight(array)

    def upload(self, array: np.ndarray):
        """A per-step input, valid until the next begin_step()."""
        host = np.ascontiguousarray(array)
        staged = self.staging_pool.take(host.shape, host.dtype)
        staged[...] = host
        out = self.device_pool.take(host.shape, host.dtype)
        if host.size:
            out.copy_to_device(staged, stream=self.stream)
        return out

    def to_host(self, array) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array
        host = array.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return host

    def zeros(self, shape, dtype=np.float32):
        """A persistent zeroed buffer (KV cache)."""
        out = cuda.device_array(shape, dtype=dtype, stream=self.stream)
        return elementwise.fill_cuda(out, 0, stream=self.stream)

    def borrow(self, region) -> None:
        """Take this step's new scratch buffers from ``region`` (1-D uint8 device memory)."""
        self.device_pool.lend(region)

    def end_borrow(self) -> None:
        """Give the region back: wait for the work that used it, then forget its buffers."""
        self.synchronize()
        self.device_pool.end_loan()

    def empty(self, shape, dtype=np.float32):
        """Per-step scratch, valid until the next begin_step()."""
        return self.device_pool.take(tuple(shape), dtype)

    def host_empty(self, shape, dtype):
        """Pinned host memory mapped into the device's address space (the expert host store): copies
        to the arena run at full speed, and kernels can read it in place."""
        return mapped_empty(shape, dtype)

    def host_device_view(self, host):
        """A device array over mapped host memory (host_empty), for kernels to read in place."""
        return device_view(host)

    def overwrite(self, target, host: np.ndarray) -> None:
        """Copy ``host`` into the persistent device array ``target`` in stream order (staged, so the
        caller may change ``host`` at once)."""
        host = np.ascontiguousarray(host)
        staged = self.staging_pool.take(host.shape, host.dtype)
        staged[...] = host
        target.copy_to_device(staged, stream=self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def private_pool(self, pool):
        """Take scratch from ``pool`` inside a with-block (a captured graph owns its buffers)."""
        return swapped(self, device_pool=pool)

    def capturing(self, builder):
        """Launch into a cuda.core GraphBuilder instead of the stream inside a with-block."""
        return swapped(self, stream=builder)

    # -- ops --------------------------------------------------------------------------------------

    def embedding(self, table, ids):
        out = self.empty((ids.shape[0], table.shape[1]))
        return embedding.embedding_cuda(table, ids, out, stream=self.stream)

    def rmsnorm(self, x, weight, eps: float):
        return rmsnorm.rmsnorm_cuda(x, weight, eps, self.empty(x.shape), stream=self.stream)

    def add_rmsnorm(self, x, y, weight, eps: float):
        """(x + y, rmsnorm(x + y)): the residual add fused with the next norm."""
        return fused.add_rmsnorm_cuda(x, y, weight, eps, self.empty(x.shape), self.empty(x.shape), stream=self.stream)

    def combine_add_rmsnorm(self, y_pair, weights, x, weight, eps: float):
        """(x + combine(y_pair, weights), its rmsnorm): the MoE's end fused with the next norm."""
        return fused.combine_add_rmsnorm_cuda(y_pair, weights, x, weight, eps, self.empty(x.shape),
                                              self.empty(x.shape), stream=self.stream)

    def qkv_rope_store(self, qkv, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, token_slot,
                       token_pos, cos, sin, k_cache, v_cache):
        """q (T, H, hd) after norm and RoPE; k and v (normed, rotated) written into the caches."""
        q = self.empty((qkv.shape[0], num_heads, q_weight.shape[0]))
        return fused.qkv_rope_store_cuda(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, token_slot,
                                         token_pos, cos, sin, k_cache, v_cache, q, stream=self.stream)

    def takes_rope_attention(self, num_heads: int, q_weight, k_weight, cos, k_cache, window: int) -> bool:
        """Whether rope_attention runs as one kernel (rope_attention.takes: the tensor-core decode attention with
        qkv_rope_store's work as its prologue)."""
        return rope_attention.takes(num_heads, q_weight, k_weight, cos, k_cache, window, self.stream)

    def rope_attention(self, qkv, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, token_slot,
                       token_pos, cos, sin, k_cache, v_cache, scale: float, window: int = 0):
        """attention(qkv_rope_store(qkv, ...), ...) of a decode step (every token the only one of its sequence):
        (T, H, hd); one kernel where takes_rope_attention, else the two."""
        shape = (qkv.shape[0], num_heads, q_weight.shape[0])
        out, q = self.empty(shape), None
        if not self.takes_rope_attention(num_heads, q_weight, k_weight, cos, k_cache, window):
            q = self.empty(shape)
        scratch = self.empty(attention.attention_scratch_shape(*shape, k_cache.shape[2]))
        return rope_attention.rope_attention_cuda(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps, token_slot,
                                                  token_pos, cos, sin, k_cache, v_cache, scale, window, out, scratch,
                                                  stream=self.stream, done=self.attention_done, q_out=q)

    def linear_qkv_rope_store(self, h, weight, num_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float,
                              token_slot, token_pos, cos, sin, k_cache, v_cache):
        """qkv_rope_store(linear(h, weight), ...); one token's in one launch with qkv_gemv.ENABLED where the
        kernel applies (bf16 / f16 weights, heads a whole number of its blocks)."""
        if qkv_gemv.ENABLED and not isinstance(weight, linear_quant.Fp8Weight):
            qkv = self.empty((h.shape[0], weight.shape[0]))
            q = self.empty((h.shape[0], num_heads, q_weight.shape[0]))
            if qkv_gemv.qkv_gemv_rope_cuda(h, weight, num_heads, num_kv_heads, q_weight, k_weight, eps, token_slot,
                                           token_pos, cos, sin, k_cache, v_cache, self.qkv_done, qkv, q,
                                           stream=self.stream):
                return q
        return self.qkv_rope_store(self.linear(h, weight), num_heads, num_kv_heads, q_weight, k_weight, eps,
                                   token_slot, token_pos, cos, sin, k_cache, v_cache)

    def linear(self, x, weight):
        out = self.empty((x.shape[0], weight.shape[0]))
        if isinstance(weight, linear_quant.Fp8Weight):
            return self._linear_fp8(x, weight, out)
        if self.tensor_cores is not None and self.tensor_cores.takes_linear(x.shape[0], weight):
            return self.tensor_cores.linear(self, x, weight, out)  # many rows, or a few (gemm.FEW_ROWS)
        return linear.linear_cuda(x, weight, out, stream=self.stream)

    def _linear_fp8(self, x, weight, out):
        """Decode: the FP8 GEMV; a step long enough for the tensor cores: the weight as bf16 scratch, a
        bounded slice of rows at a time (an FP8 lm_head is 622 MB as bf16: linear_quant_slices.py)."""
        if self.tensor_cores is not None and x.shape[0] >= self.tensor_cores.min_rows:
            return linear_quant_slices.linear_fp8_sliced(self, self.tensor_cores, x, weight, out)
        return linear_quant.linear_fp8_cuda(x, weight.codes, weight.scales, out, stream=self.stream)

    def add(self, x, y):
        return elementwise.add_cuda(x, y, self.empty(x.shape), stream=self.stream)

    def swiglu(self, gate, up):
        return elementwise.swiglu_cuda(gate, up, self.empty(gate.shape), stream=self.stream)

    def rope(self, x, positions, cos, sin):
        return rope.rope_cuda(x, positions, cos, sin, self.empty(x.shape), stream=self.stream)

    def kv_store(self, k_cache, v_cache, k, v, token_slot, token_pos) -> None:
        attention.kv_store_cuda(k_cache, v_cache, k, v, token_slot, token_pos, stream=self.stream)

    def attention(self, q, k_cache, v_cache, token_slot, token_pos, scale: float, window: int = 0, segments=None,
                  tiles=None):
        """``segments``: the step's sequences as host (first row, slot, start, length) tuples, for
        the tensor-core path of a long step (prefill_attention.py); None for a decode step.
        ``tiles``: a routed step's tile table (device, attention_chunk.py): a chunk's rows share
        their keys' reads on tensor cores (bf16 caches, no sliding window)."""
        out = self.empty(q.shape)
        if tiles is not None:
            scratch = self.empty(attention.attention_scratch_shape(*q.shape, k_cache.shape[2]))
            return attention_chunk.attention_tiles_cuda(q, k_cache, v_cache, tiles, token_slot, token_pos, scale, out,
                                                        scratch, self.empty((q.shape[0],), np.int32),
                                                        stream=self.stream)
        if segments is not None and self.tensor_cores is not None and q.shape[0] >= self.tensor_cores.min_rows:
            return prefill_attention.prefill_attention(self, self.tensor_cores, q, k_cache, v_cache, segments, scale,
                                                       window or 0, out)
        scratch = self.empty(attention.attention_scratch_shape(*q.shape, k_cache.shape[2]))
        return attention.attention_cuda(q, k_cache, v_cache, token_slot, token_pos, scale, window, out, scratch,
                                        stream=self.stream, done=self.attention_done)

    def topk_softmax(self, logits, top_k: int, normalize: bool, ids=None):
        """``ids``: a (T, top_k) int32 array to write the choices into (else scratch)."""
        shape = (logits.shape[0], top_k)
        ids = self.empty(shape, np.int32) if ids is None else ids
        weights = self.empty(shape, np.float32)
        return moe.topk_softmax_cuda(logits, top_k, normalize, ids, weights, stream=self.stream)

    def route_pairs(self, ids, table, layer_row: int):
        num_pairs = ids.shape[0] * ids.shape[1]
        tables = [self.empty((num_pairs,), np.int32) for _ in range(3)]
        return routing.route_pairs_cuda(ids, table, layer_row, *tables, stream=self.stream)

    def norm_route(self, x, y, norm_weight, eps: float, router, top_k: int, normalize: bool, table, layer_row: int,
                   ids):
        """Decode's MLP entry in one launch: (x + y, its rmsnorm h, the router's top-k ids (written
        into ``ids``, (T, top_k) int32) and weights of h, then pair_token, pair_slot, pair_out)."""
        num_tokens, num_pairs = x.shape[0], x.shape[0] * top_k
        total, h, weights = self.empty(x.shape), self.empty(x.shape), self.empty((num_tokens, top_k))
        pairs = [self.empty((num_pairs,), np.int32) for _ in range(3)]
        scratch = self.empty((num_tokens, router.shape[0]))  # the logits, where the router's rows are spread
        return norm_route_cuda(x, y, norm_weight, eps, router, top_k, normalize, table, layer_row, self.route_done,
                               total, h, ids, weights, *pairs, stream=self.stream, scratch=scratch)

    def linear_norm_route(self, a, weight, x, norm_weight, eps: float, router, top_k: int, normalize: bool, table,
                          layer_row: int, ids):
        """norm_route(x, linear(a, weight), ...): the routed decode's o projection and MLP entry. With FP8
        projections on tensor cores and linear_quant_mma.ROUTE, the projection's kernel adds the residual and the
        router's partial sums and one block ends the routing (route_end.launch, or route_tail_cuda where it does not
        take the step): two launches for three."""
        if not (isinstance(weight, linear_quant.Fp8Weight) and linear_quant_mma.takes_route(
                a, weight.codes, weight.scales, x, norm_weight, router, self.stream)):
            return self.norm_route(x, self.linear(a, weight), norm_weight, eps, router, top_k, normalize, table,
                                   layer_row, ids)
        total, partial, weights, pairs = self._route_start(a, weight, x, norm_weight, router, top_k)
        h = self.empty(x.shape)
        if route_end.takes(partial, total, norm_weight, top_k, self.stream):  # route_tail's bits in CUDA C
            route_end.launch(partial, total, norm_weight, eps, top_k, normalize, table, layer_row, h, ids, weights,
                             *pairs, self.stream)
        else:
            route_tail_cuda(partial, total, norm_weight, eps, top_k, normalize, table, layer_row, h, ids, weights,
                            *pairs, stream=self.stream)
        return (total, h, ids, weights, *pairs)

    def _route_start(self, a, weight, x, norm_weight, router, top_k: int):
        """The o projection's ROUTE entry (linear_quant_mma.launch_route) into (total, partial), with the routing's
        outputs still to write: (total, partial, weights (1, top_k), the three pair tables (top_k,))."""
        total, weights = self.empty(x.shape), self.empty((1, top_k))
        pairs = [self.empty((top_k,), np.int32) for _ in range(3)]
        partial = self.empty((x.shape[1] // 16, router.shape[0] + 1))
        linear_quant_mma.launch_route(a, weight.codes, weight.scales, x, norm_weight, router, total, partial,
                                      self.stream)
        return total, partial, weights, pairs

    def routes_experts(self, a, weight, x, norm_weight, router, top_k: int, arena, store, layout) -> bool:
        """Whether ``linear_route_experts`` runs here: one token, the o projection's ROUTE entry
        (linear_quant_mma.takes_route) and quantized experts whose gate|up ends the routing
        (moe_quant_mma.takes_routed)."""
        return (a.shape[0] == 1 and layout is not None and isinstance(weight, linear_quant.Fp8Weight)
                and moe_quant_mma.takes_routed(layout, router.shape[0], top_k, arena, store, self.stream)
                and linear_quant_mma.takes_route(a, weight.codes, weight.scales, x, norm_weight, router, self.stream))

    def linear_route_experts(self, a, weight, x, norm_weight, eps: float, router, top_k: int, normalize: bool, table,
                             layer_row: int, ids, arena, store, layout, out):
        """linear_norm_route then expert_ffn (where ``routes_experts``) in three launches: the o projection's ROUTE
        entry, the gate|up GEMV ending the routing in every block (no route_tail kernel), the down GEMV. ``out``
        (top_k, D) takes the pairs' outputs; returns (x + o, out, the routing weights (1, top_k)); ``ids``
        (1, top_k) the chosen experts. ``out`` None (where ``combines_experts`` with ``early`` False): the down GEMV
        ends in the combine; returns (x + o + the combine, the 16-row tiles' sums of its squares, the weights)."""
        total, partial, weights, pairs = self._route_start(a, weight, x, norm_weight, router, top_k)
        h = self.empty((top_k, layout.inter))
        moe_quant_mma.launch_gate_up_routed(total, partial, norm_weight, eps, table, layer_row, top_k, normalize,
                                            arena, store, layout, ids, weights, *pairs, h, self.stream)
        # never the early down GEMV: its pair tables, read before its wait, are the gate|up kernel's own writes (a
        # down GEMV redoing the routing before its wait to keep its early loads was slower: 511.6 against 529.1 tok/s)
        if out is None:
            combined, square = self.empty(x.shape), self.empty((x.shape[1] // 16,))
            moe_quant_mma.launch_down_combine(h, pairs[1], pairs[2], weights, arena, store, layout, total, combined,
                                              square, self.stream, early=False)
            return combined, square, weights
        moe_quant_mma.launch_down(h, *pairs, arena, store, layout, out, self.stream, early=False)
        return total, out, weights

    def expert_ffn(self, x, pair_token, pair_slot, pair_out, arena, hidden: int, inter: int, out, store=None,
                   layout=None):
        """``layout``: the experts' quantized layout (fp8 / int4 blobs); None for bf16 blobs."""
        scratch = self.empty((pair_slot.shape[0], inter))
        if layout is not None:
            return moe_quant.expert_ffn_quant_cuda(x, pair_token, pair_slot, pair_out, arena, layout, out, scratch,
                                                   stream=self.stream, store=store)
        return moe_ffn.expert_ffn_cuda(x, pair_token, pair_slot, pair_out, arena, hidden, inter, out, scratch,
                                       stream=self.stream, store=store)

    def combines_experts(self, h, top_k: int, arena, store, layout, early: bool | None = None) -> bool:
        """Whether ``expert_ffn_combine`` runs here: one token, quantized experts whose down GEMV ends in the combine
        (moe_quant_mma.takes_combine; ``early``: its tables read before its wait, None: the step's choice;
        linear_route_experts' down never does)."""
        return (h.shape[0] == 1 and layout is not None
                and moe_quant_mma.takes_combine(layout, top_k, arena, store, self.stream, early))

    def expert_ffn_combine(self, h, pair_token, pair_slot, pair_out, arena, layout, weights, x, store=None):
        """expert_ffn then the combine and the residual add (where ``combines_experts``), in two launches: the gate|up
        GEMV, the down GEMV ending in the combine. Returns (x + combine, the 16-row tiles' sums of its squares
        (D / 16,)), from which the next norm takes 1 / rms (linear_normed)."""
        store = arena if store is None else store
        scratch = self.empty((pair_slot.shape[0], layout.inter))
        total, square = self.empty(x.shape), self.empty((x.shape[1] // 16,))
        moe_quant_mma.launch_gate_up(h, pair_token, pair_slot, pair_out, arena, store, layout, scratch, self.stream)
        moe_quant_mma.launch_down_combine(scratch, pair_slot, pair_out, weights, arena, store, layout, x, total, square,
                                          self.stream)
        return total, square

    def linear_normed(self, x, square, norm_weight, eps: float, weight):
        """linear(rmsnorm(x, norm_weight), weight), ``square`` the 16-row tiles' sums of x^2 (expert_ffn_combine's):
        an FP8 projection on tensor cores normalizes x while it stages it (linear_quant_mma.launch_normed), else the
        two launches."""
        if isinstance(weight, linear_quant.Fp8Weight) and linear_quant_mma.takes_normed(
                x, weight.codes, weight.scales, square, norm_weight, self.stream):
            out = self.empty((x.shape[0], weight.shape[0]))
            return linear_quant_mma.launch_normed(x, weight.codes, weight.scales, square, norm_weight, eps, out,
                                                  self.stream)
        return self.linear(self.rmsnorm(x, norm_weight, eps), weight)

    def combine(self, y_pair, weights):
        out = self.empty((weights.shape[0], y_pair.shape[1]))
        return moe.combine_cuda(y_pair, weights, out, stream=self.stream)

    def top_logprobs(self, logits, n: int):
        """(ids, logprobs), each (S, n): the n most likely ids of each row of logits."""
        shape = (logits.shape[0], n)
        return top_logprobs.top_logprobs_cuda(logits, n, self.empty(shape, np.int32), self.empty(shape, np.float32),
                                              stream=self.stream)

    def sample(self, logits, temperature, top_k, top_p, u, mask=None, mask_rows=None):
        num_rows = logits.shape[0]
        tokens, logprobs = self.empty((num_rows,), np.int32), self.empty((num_rows,), np.float32)
        return sampling.sample_cuda(logits, temperature, top_k, top_p, u, tokens, logprobs,
                                    self.empty(logits.shape), stream=self.stream, mask=mask, mask_rows=mask_rows)

    # -- vision tower and stage-0 image embeddings -------------------------------------------------

    def layernorm(self, x, weight, bias, eps: float):
        return layernorm.layernorm_cuda(x, weight, bias, eps, self.empty(x.shape), stream=self.stream)

    def tiled_linear(self, x, weight, bias=None):
        """x @ weight^T (+ bias) for many rows (a tower's patches); ``linear`` suits a few tokens.
        x: float32, or split already (SplitRows, from the ``*_into`` ops)."""
        out = self.empty((x.shape[0], weight.shape[0]))
        if isinstance(x, split_epilogues.SplitRows):
            return split_epilogues.linear_of_parts(self, x, weight, bias, out)
        if self.tensor_cores is not None and self.tensor_cores.wants(x.shape[0], weight):
            if bias is None or bias.dtype == np.uint16:  # a bf16 bias: added by a row kernel of gemm.py
                return self.tensor_cores.linear(self, x, weight, out, bias)
            out = self.tensor_cores.linear(self, x, weight, out)
            return activations.add_bias_cuda(out, bias, out, stream=self.stream)
        return tiled_linear.tiled_linear_cuda(x, weight, bias, out, stream=self.stream)

    def activation(self, x, name: str):
        return activations.activation_cuda(x, name, self.empty(x.shape), stream=self.stream)

    def bias_activation(self, y, bias, name: str):
        """activation(y + bias): a product's bias added where its output is read (tiled_linear.py)."""
        return tiled_linear.bias_activation_cuda(y, bias, name, self.empty(y.shape), stream=self.stream)

    def bias_residual(self, x, y, bias):
        """x + (y + bias): a product's bias added in the residual add."""
        return tiled_linear.bias_residual_cuda(x, y, bias, self.empty(y.shape), stream=self.stream)

    def add_bias(self, x, bias):
        return activations.add_bias_cuda(x, bias, self.empty(x.shape), stream=self.stream)

    def vision_attention(self, q, k, v, num_images: int, scale: float):
        if self.tensor_cores is not None and q.shape[0] >= self.tensor_cores.min_rows:
            return vision_attention.image_attention_cuda(self, q, k, v, num_images, scale, self.empty(q.shape))
        return vision_attention.vision_attention_cuda(q, k, v, num_images, scale, self.empty(q.shape),
                                                      stream=self.stream)

    def scatter_rows(self, x, rows, values):
        """In place: rows ``rows`` of ``x`` become ``values``; returns ``x``."""
        return scatter.scatter_rows_cuda(x, rows, values, stream=self.stream)
    def apply_rules(self, logits, temperature, rules):
        """The logit rules of a step (host ``LogitRules``) on a copy of the logits."""
        penalties.check_rules(rules, *logits.shape)
        arrays = (self.upload(a) for a in (rules.params, rules.offsets, rules.ids, rules.counts, rules.bias))
        return penalties.apply_rules_cuda(logits, temperature, *arrays, self.empty(logits.shape), stream=self.stream)

    def token_logprobs(self, logits, tokens):
        out = self.empty((logits.shape[0],), np.float32)
        return penalties.token_logprobs_cuda(logits, tokens, out, stream=self.stream)

    # -- Qwen3-VL ---------------------------------------------------------------------------------

    def mrope(self, x, positions, axes, cos, sin, bias=None):
        """Rotary embedding with a position per axis (M-RoPE, the tower's 2-D rotary), of x + bias."""
        return mrope.mrope_cuda(x, positions, axes, cos, sin, self.empty(x.shape), stream=self.stream, bias=bias)

    def weighted_rows(self, table, indices, weights):
        """sum_k weights[:, k] * table[indices[:, k]] (interpolated position embeddings)."""
        out = self.empty((indices.shape[0], table.shape[1]))
        return weighted_rows.weighted_rows_cuda(table, indices, weights, out, stream=self.stream)

    def pixel_patches(self, pixels, values, patch: int, merge: int, temporal: int):
        """An image's (H, W, C) uint8 pixels -> its tower patches, looked up in ``values`` (patchify.py)."""
        out = self.empty(patchify.patches_shape(pixels.shape, patch, temporal))
        return patchify.pixel_patches_cuda(pixels, values, out, patch, merge, temporal, stream=self.stream)
