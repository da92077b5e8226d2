"""A stage: a contiguous range of decoder layers on one device. The first stage embeds tokens, the
last applies the final norm and lm_head and samples; every stage keeps the KV cache of its layers
and reads its experts through the expert cache's placement table (arena slot or host store).

A decode step (<= ROUTED_MAX_TOKENS tokens) routes on the device and, on cuda, is captured once per
batch size as a CUDA graph and replayed (one input copy, one launch, one output copy); so is a
routed step with a prompt's chunk beside decode rows, from the second step of its shape; the same
``_run`` runs eagerly on cpu, in the simulator and when graphs are off, with identical results. Its
experts run as GEMVs, or in tiles on tensor cores where each gets a few pairs (moe_prefill.py).
Longer steps (prefill) group experts by expert: on tensor cores where the backend has them and
the experts are bf16 (moe_prefill.py, planned on the device where the cache holds a whole layer),
else on the host with GEMVs (``_moe``)."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from moebus.common.fp8_dense import ATTENTION_DTYPES, LM_HEAD_DTYPES, attention_fp8, concat_rows, lm_head_fp8
from moebus.cuda.backends import passes_capture
from moebus.cuda.kernels import moe_quant_round
from moebus.cuda.kernels.attention_chunk import chunk_tiles
from moebus.cuda.kernels.fused import can_fuse_heads
from moebus.cuda.kernels.mrope import mrope_axes
from moebus.cuda.kernels.rope import rope_tables
from moebus.cuda.memory.host_table import embedding_in_vram
from moebus.workers import spanning_chunk
from moebus.workers.batch import StageOutput, StepBatch
from moebus.workers.kv_cache import KVCache
from moebus.workers.prompt_loan import forward_in_pieces, prompt_loan
from moebus.workers.qwen3vl_step import add_deepstack, deepstack_inputs, rope_positions
from moebus.workers.experts import build_expert_cache
from moebus.workers.moe_prefill import can_group_on_device, grouped_moe, grouped_moe_placed, groups_in_decode

log = logging.getLogger("moebus.stage")
ROUTED_MAX_TOKENS = 64  # steps up to this many tokens route on the device (decode); longer ones group on the host


class Stage:
    def __init__(self, ckpt, layers: range, backend, num_slots: int, max_context: int, experts=None,
                 progress=iter, use_graphs: bool | None = None, kv_dtype: str = "fp32", attention_dtype: str = "bf16",
                 lm_head_dtype: str = "bf16"):
        """``use_graphs``: replay decode steps as CUDA graphs on cuda (None: unless MOEBUS_CUDA_GRAPHS=0);
        ``kv_dtype``: the KV cache's elements, bf16 or fp32 (kv_cache.py); ``attention_dtype``: the
        q/k/v/o projections', bf16 or fp8 (common/fp8_dense.py); ``lm_head_dtype``: the lm_head's, the same."""
        if attention_dtype not in ATTENTION_DTYPES:
            raise ValueError(f"attention dtype {attention_dtype!r}: choose one of {', '.join(ATTENTION_DTYPES)}")
        if lm_head_dtype not in LM_HEAD_DTYPES:
            raise ValueError(f"lm_head dtype {lm_head_dtype!r}: choose one of {', '.join(LM_HEAD_DTYPES)}")
        self.attention_dtype, self.lm_head_dtype = attention_dtype, lm_head_dtype
        cfg = self.cfg = ckpt.config
        if not (0 <= layers.start < layers.stop <= cfg.num_layers):
            raise ValueError(f"layer range {layers} outside the model's {cfg.num_layers} layers")
        self.ops = backend
        self.layer_range = layers
        self.is_first = layers.start == 0
        self.is_last = layers.stop == cfg.num_layers
        self.max_context = max_context
        self.scratch = None  # a ScratchBudget when activations must fit a VRAM budget (workers)
        self.scratch_choices = None  # (measured, widened) on a GPU with room beside its cache (gpu_worker.py)
        if self.is_first:
            table = ckpt.embedding()
            self.embed = backend.token_table(table)
            if backend.name == "cuda":
                where = "VRAM (MOEBUS_EMBEDDING_VRAM=1)" if embedding_in_vram() else "mapped host memory"
                log.info("token embedding: %.1f MiB in %s", table.nbytes / 2**20, where)
        if self.is_last:
            self.final_norm = backend.weight(ckpt.final_norm())
            self.lm_head = (backend.fp8_weight(*lm_head_fp8(ckpt)) if lm_head_dtype == "fp8"
                            else backend.weight(ckpt.lm_head()))
        # M-RoPE (Qwen3-VL) rotates by per-axis positions, which the fused qkv kernel does not take
        self.mrope_axes = backend.persist(mrope_axes(cfg.head_dim, cfg.mrope_section)) if cfg.mrope_section else None
        self.fuse_qkv = bool(cfg.qk_norm) and can_fuse_heads(cfg.head_dim) and self.mrope_axes is None
        self.layers = {i: self._load_layer(ckpt, i) for i in progress(layers)}
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, max_context)
        self.cos, self.sin = backend.persist(cos), backend.persist(sin)
        self.kv = KVCache(backend, len(layers), num_slots, cfg.num_kv_heads, max_context, cfg.head_dim, kv_dtype)
        from moebus.cuda.backends.graphs import graphs_available

        if use_graphs is None:
            use_graphs = os.environ.get("MOEBUS_CUDA_GRAPHS", "1") != "0"
        self.use_graphs = bool(use_graphs) and backend.name == "cuda" and graphs_available()
        self.graphs: dict = {}  # (batch size, masked) -> CapturedStep
        self.graph_down_early: dict = {}  # ... -> moe_quant_round.down_early_for at its capture
        self.graph_pool = None  # their shared scratch (graphs.shared_pool), made with the first
        # a routed step with a prompt's chunk: its rows share their keys' reads (attention_chunk.py)
        self.tile_rows = chunk_attention(cfg, backend.name, kv_dtype)
        self.graph_captures = self.eager_short_steps = 0  # for INFO: a graph recaptured per step shows here
        self.mixed_shapes: dict = {}  # (tokens, masked, sequences) of routed steps with chunks -> times seen
        self.mixed_counted = None  # the last step counted there
        # a prompt's chunk beside decode rows copies at most this many bytes of experts a step, and
        # spans steps (spanning_chunk.py; 0: a chunk runs whole in its step)
        self.chunk_copy_budget_bytes = 0
        # and, beside decode rows, its work in a step ends once it took this many times what the
        # decode rows took (0: the copy budget alone; a cuda worker sets spanning_chunk.TIME_SHARE)
        self.chunk_time_share = 0.0
        self.chunk_overlap = False  # decode rows beside a chunk launched, read after it (cuda: chunk_rows.OVERLAP)
        self.replay_s = None  # the last replayed step's host time (a new chunk's first guess of its rows' time)
        self.chunk = None  # the chunk in progress (spanning_chunk.ChunkInProgress)
        self.chunks_spanned = self.chunk_steps = self.chunks_dropped = 0  # for INFO
        self.warmed_products = 0  # spanning_chunk.warm's cuBLAS products (moe_prefill.warm_products)
        self.warmed_dense = 0  # and its dense products' cuBLAS calls (moe_prefill.warm_dense)
        self.chunk_layer_entry_s = 0.0  # the last spanning chunk's last layer entry (chunk_advance.SETUP_STEP)
        # experts last: an elastic cache is sized from the VRAM left after dense weights, KV cache
        # and the step scratch (which a worker measures with a warm-up step of this stage)
        if experts is None:
            experts = build_expert_cache(ckpt, layers, backend)
        self.experts = experts(self) if callable(experts) else experts

    def _load_layer(self, ckpt, i: int) -> dict:
        tensors = ckpt.attention(i)
        if self.attention_dtype == "fp8":  # q, k, v, o as (codes, scales)
            tensors.update(attention_fp8(ckpt, i, tensors))
        if self.fuse_qkv:  # one projection launch; the fused kernel splits its columns
            parts = [tensors.pop("q"), tensors.pop("k"), tensors.pop("v")]
            tensors["qkv"] = concat_rows(parts) if isinstance(parts[0], tuple) else np.concatenate(parts)
        w = {k: self.ops.fp8_weight(*v) if isinstance(v, tuple) else self.ops.weight(v) for k, v in tensors.items()}
        if self.cfg.is_moe_layer(i):
            w["router"] = self.ops.weight(ckpt.router(i))
        else:
            w.update({"mlp_" + k: self.ops.weight(v) for k, v in ckpt.dense_mlp(i).items()})
        return w

    # -- forward ----------------------------------------------------------------------------

    def forward(self, batch: StepBatch, hidden: np.ndarray | None = None, want_logits: bool = False) -> StageOutput:
        """Run this stage's layers over one step. ``hidden`` (T, D) comes from the previous stage.
        A step longer than the standing scratch covers runs on the prompt-path loan (prompt_loan.py).
        A prompt's chunk beside decode rows whose experts must be copied in may span steps
        (spanning_chunk.py): its row is then in the output's ``pending_rows`` until it is done."""
        self.check(batch)
        row = spanning_chunk.chosen_row(self, batch, hidden, ROUTED_MAX_TOKENS)
        if row is not None:
            return spanning_chunk.forward(self, batch, row, want_logits)
        if self.chunk is not None and self.chunk.slot in batch.slots:
            spanning_chunk.drop(self, "its feed runs whole")
        return self.forward_whole(batch, hidden, want_logits)

    def forward_whole(self, batch: StepBatch, hidden, want_logits: bool = False) -> StageOutput:
        """The step in one pass (on the prompt-path loan, in pieces where it is short)."""
        if self.scratch is None or batch.num_tokens <= self.scratch.tokens:
            return self._forward(batch, hidden, want_logits)
        with prompt_loan(self.experts, self.ops, self.scratch, batch.num_tokens) as max_piece_tokens:
            if max_piece_tokens >= batch.num_tokens:
                return self._forward(batch, hidden, want_logits)
            return forward_in_pieces(self._forward, batch, hidden, want_logits, max_piece_tokens, self.is_last)

    def check(self, batch: StepBatch) -> None:
        """Refuse a step whose positions or KV slots this stage does not have, before any work. Every
        step the worker runs passes here once (forward, overlap.launch): a held chunk that the step
        says will not continue is dropped (spanning_chunk.note_step)."""
        self._check_bounds(batch)
        spanning_chunk.note_step(self, batch)

    def _check_bounds(self, batch: StepBatch) -> None:
        if int((batch.starts + batch.lengths).max()) > self.max_context:
            raise ValueError(f"a sequence exceeds max_context {self.max_context}")
        if int(batch.slots.min()) < 0 or int(batch.slots.max()) >= self.kv.num_slots:
            raise ValueError(f"a KV slot outside [0, {self.kv.num_slots})")
        if batch.rope_positions is not None and batch.num_tokens and int(batch.rope_positions.max()) >= self.max_context:
            raise ValueError(f"a rope position exceeds max_context {self.max_context}")

    def _forward(self, batch: StepBatch, hidden, want_logits: bool) -> StageOutput:
        self._check_bounds(batch)
        routed = batch.num_tokens <= ROUTED_MAX_TOKENS
        inputs = self._host_inputs(batch, hidden)
        graph = self._graph_for(batch, inputs) if routed else None
        if graph is not None:
            began = time.perf_counter()
            self.ops.begin_step()
            self.experts.device_placement(self.ops)  # the graph reads the table at its fixed address
            out = graph.replay(inputs, self._wanted(batch, want_logits))
            device_out = graph.outputs  # valid until the next replay
            self.replay_s = time.perf_counter() - began
        else:
            self.eager_short_steps += routed
            out, device_out = self._eager(batch, inputs, routed, want_logits)
        if self.is_last and batch.top_logprobs:
            out["top_ids"], out["top_logprobs"] = self._top_logprobs(batch, device_out["logits"])
        if "prefetch_keys" in out:  # before observe: what was prefetched for these choices
            self.experts.observe_prefetch(out["prefetch_keys"], out["expert_ids"])
        if "expert_ids" in out:
            self.experts.observe(out["expert_ids"], self.ops)
        if not self.is_last:
            return StageOutput(hidden=out["hidden"])
        return self._sample_output(batch, out, want_logits)

    def _top_logprobs(self, batch: StepBatch, logits) -> tuple[np.ndarray, np.ndarray]:
        """Top-n of the rows that asked only, on the device: (R, n) comes back, and a batch where one
        request wants logprobs does not make the other rows pay the vocabulary passes."""
        rows, n = batch.top_rows(), batch.top_logprobs
        if not len(rows):  # the rows that asked do not sample in this piece
            return np.zeros((0, n), np.int32), np.zeros((0, n), np.float32)
        if len(rows) < batch.num_seqs:
            logits = self.ops.embedding(logits, self.ops.upload(rows))  # gather the asking rows
        ids, logprobs = self.ops.top_logprobs(logits, n)
        return self.ops.to_host(ids), self.ops.to_host(logprobs)

    def _eager(self, batch: StepBatch, inputs: dict, routed: bool, want_logits: bool) -> dict:
        ops = self.ops
        ops.begin_step()
        try:
            result = self._run(batch, {name: ops.upload(a) for name, a in inputs.items()}, routed)
        finally:
            self.experts.release()
        return {name: ops.to_host(result[name]) for name in self._wanted(batch, want_logits) if name in result}, result

    def _wanted(self, batch: StepBatch, want_logits: bool) -> list[str]:
        """The outputs that come back to the host: one step's results and its routing choices."""
        names = ["expert_ids"] if self.experts.store.layers and batch.num_tokens <= ROUTED_MAX_TOKENS else []
        names += ["prefetch_keys"] if names and self._prefetch() is not None else []
        if not self.is_last:
            return names + ["hidden"]
        return names + ["tokens", "logprobs"] + (["logits"] if want_logits else [])

    def _host_inputs(self, batch: StepBatch, hidden) -> dict:
        inputs = {"token_slot": batch.token_slots(), "token_pos": batch.token_positions()}
        if self.mrope_axes is not None:
            inputs["rope_pos"] = rope_positions(batch, inputs["token_pos"])
            inputs.update(deepstack_inputs(batch, self.layer_range))
        if self.is_first:
            inputs["tokens"] = batch.tokens
            if batch.embeds is not None and len(batch.embed_rows):  # image embeddings at their tokens
                inputs.update(embed_rows=batch.embed_rows, embeds=batch.embeds)
        else:
            inputs["hidden"] = np.ascontiguousarray(hidden, dtype=np.float32)
        if self.tile_rows and batch.num_seqs != batch.num_tokens and batch.num_tokens <= ROUTED_MAX_TOKENS:
            inputs["attn_tiles"] = chunk_tiles(_segments(batch), batch.num_tokens, self.tile_rows)
        if self.is_last:
            temperature, top_k, top_p, u = batch.sampling_arrays()
            inputs.update(last_index=batch.last_token_index(), temperature=temperature, top_k=top_k, top_p=top_p, u=u,
                          **batch.mask_inputs())
        return inputs

    def _graph_for(self, batch: StepBatch, inputs: dict):
        """The captured decode step for this batch size, captured on first use (None: run eagerly). A
        routed step with a prompt's chunk beside decode rows (a long prompt read while others decode)
        is captured from the second step of its shape on: an eager step of many layers costs its
        Python launches (~10x the graph), and the chunks of one prompt repeat one shape. A batch whose
        image embeddings are empty (the decode rows of an image prompt's spanning chunk step, which
        ``select_rows`` leaves with no rows of the image) is a plain decode step: it replays too."""
        images = batch.embeds is not None and len(batch.embeds) > 0
        if not self.use_graphs or batch.extras or images or batch.logit_rules is not None or batch.deepstack is not None:
            return None
        key = (batch.num_tokens, "mask" in inputs)  # a batch with a constrained row has its own graph
        if batch.num_seqs != batch.num_tokens:  # chunks: their own graphs, once the shape comes again
            key += (batch.num_seqs,)
            if self.mixed_counted is not batch:  # a worker may ask twice for one step (overlap.launch)
                self.mixed_counted = batch
                self.mixed_shapes[key] = self.mixed_shapes.get(key, 0) + 1
            if self.mixed_shapes[key] < 2 and key not in self.graphs:
                return None
        graph = self.graphs.get(key)
        down_early = moe_quant_round.down_early_for(self.experts)  # a graph with early down loads: all resident only
        if graph is not None and graph.matches(inputs) and (down_early or not self.graph_down_early.get(key, False)):
            return graph
        from moebus.cuda.backends.graphs import CapturedStep, shared_pool

        if graph is not None:
            graph.close()
        self.ops.begin_step()
        self.experts.device_placement(self.ops)
        self.graph_captures += 1
        self.graph_pool = self.graph_pool or shared_pool()
        try:
            graph = self.graphs[key] = CapturedStep(self.ops, inputs, lambda dev: self._run(batch, dev, routed=True),
                                                    pool=self.graph_pool)
            self.graph_down_early[key] = down_early
        except Exception as e:  # noqa: BLE001 - a driver or binding that cannot capture: serve eagerly
            self.graphs.pop(key, None)
            if passes_capture(e):
                raise  # out of memory fails this step only; graphs stay on for the next
            if len(key) > 2:  # a chunk's shape: that shape runs eagerly, decode keeps its graphs
                log.warning("CUDA graph capture of a %s-token step of %s sequences failed (%s: %s); it runs eagerly",
                            key[0], key[2], type(e).__name__, e)
                self.mixed_shapes[key] = -1 << 30
                return None
            log.warning("CUDA graph capture failed (%s: %s); decode runs eagerly", type(e).__name__, e)
            self.use_graphs = False
            return None
        return graph

    def _run(self, batch: StepBatch, inputs: dict, routed: bool) -> dict:
        """The step on the device: kernels only when ``routed`` (so it can be captured)."""
        ops = self.ops
        moe_quant_round.choose_down_early(self.experts if routed else None)  # early down loads: all resident only
        token_slot, token_pos = inputs["token_slot"], inputs["token_pos"]
        if self.is_first:
            x = ops.embedding(self.embed, inputs["tokens"])
            if "embeds" in inputs:
                x = ops.scatter_rows(x, inputs["embed_rows"], inputs["embeds"])
        else:
            x = inputs["hidden"]
        out = {}
        route = None
        if routed and self.experts.store.layers:
            shape = (len(self.experts.store.layers), batch.num_tokens, self.cfg.top_k)
            out["expert_ids"] = ops.empty(shape, np.int32)
            route = (self.experts.device_placement(ops), out["expert_ids"], self._prefetch())
            if route[2] is not None:
                route[2].begin(ops)
                out["prefetch_keys"] = route[2].keys(ops)
        residual = None
        segments = None if routed else _segments(batch)  # a long step's sequences, for its attention
        mark = ops.layer_mark()  # what was taken before (inputs, routing table) lives all step
        own_keys = routed and batch.num_seqs == batch.num_tokens  # no token reads another's new key (rope_attention)
        for n, i in enumerate(self.layer_range):
            x, residual = self._layer(n, i, x, token_slot, token_pos, route, residual, segments, inputs.get("rope_pos"),
                                      inputs.get("attn_tiles"), own_keys)
            if "deepstack" in inputs and i < inputs["deepstack"].shape[0]:  # Qwen3-VL's DeepStack
                x, residual = add_deepstack(ops, self._residual_add(x, residual), inputs, i), None
            # the rest of the layer's buffers serve the next
            ops.recycle_layer(mark, (x,) + (residual[1:] if residual else ()))
        if not self.is_last:
            out["hidden"] = self._residual_add(x, residual)
            return out
        return self._head(batch, inputs, x, residual, out)

    def _head(self, batch: StepBatch, inputs: dict, x, residual, out: dict) -> dict:
        """The last stage's end of a step: final norm, lm_head over each sequence's last token, sampling."""
        ops = self.ops
        _, h = self._residual_norm(x, residual, self.final_norm)
        logits = ops.linear(ops.embedding(h, inputs["last_index"]), self.lm_head)
        sampling = inputs["temperature"], inputs["top_k"], inputs["top_p"], inputs["u"]
        masks = {name: inputs[name] for name in ("mask", "mask_rows") if name in inputs}  # structured outputs
        if batch.logit_rules is None:
            tokens, logprobs = ops.sample(logits, *sampling, **masks)
        else:  # penalties, bias, min_p first; the reported logprobs stay those of the raw logits
            tokens, _ = ops.sample(ops.apply_rules(logits, inputs["temperature"], batch.logit_rules), *sampling,
                                   **masks)
            logprobs = ops.token_logprobs(logits, tokens)
        out.update(tokens=tokens, logprobs=logprobs, logits=logits)
        return out

    def _residual_norm(self, x, residual, weight):
        """(x + residual, its rmsnorm): the pending residual add fused with the norm after it.
        ``residual``: None, ("dense", y), ("moe", y_pair, weights) (the MoE's combine fused too) or ("normed",
        square): x is whole, ``square`` its 16-row tiles' sums of squares (the down GEMV ended in the combine)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        if residual is None or residual[0] == "normed":
            return x, ops.rmsnorm(x, weight, eps)
        if residual[0] == "moe":
            return ops.combine_add_rmsnorm(residual[1], residual[2], x, weight, eps)
        return ops.add_rmsnorm(x, residual[1], weight, eps)

    def _residual_add(self, x, residual):
        if residual is None or residual[0] == "normed":
            return x
        y = self.ops.combine(residual[1], residual[2]) if residual[0] == "moe" else residual[1]
        return self.ops.add(x, y)

    def _layer(self, n: int, i: int, x, token_slot, token_pos, route=None, residual=None, segments=None,
               rope_pos=None, tiles=None, own_keys: bool = False):
        """One decoder layer. ``residual``: the previous layer's MLP output, still to be added to x
        (fused with this layer's first norm, see _residual_norm); returns (x, this layer's). ``own_keys``: every
        token is the only one of its sequence in the step (a decode step; _attend)."""
        ops, cfg, w = self.ops, self.cfg, self.layers[i]
        if cfg.is_moe_layer(i) and route is not None:  # the o projection with the routing (linear_norm_route)
            x, a = self._attend(n, i, x, token_slot, token_pos, residual, segments, rope_pos, tiles, project=False,
                                own_keys=own_keys)
            return self._moe_routed(i, w, x, a, *route)
        x, o = self._attend(n, i, x, token_slot, token_pos, residual, segments, rope_pos, tiles, own_keys=own_keys)
        num_tokens, eps = x.shape[0], cfg.rms_norm_eps
        x, h = ops.add_rmsnorm(x, o, w["mlp_norm"], eps)
        if cfg.is_moe_layer(i) and can_group_on_device(ops, self.experts, num_tokens):
            ids, weights = ops.topk_softmax(ops.linear(h, w["router"]), cfg.top_k, cfg.norm_topk_prob)
            y_pair = grouped_moe(ops, self.experts, i, h, ids, cfg.hidden_size, cfg.moe_intermediate_size,
                                 cfg.num_experts)
            return x, ("moe", y_pair, weights)  # tensor cores (moe_prefill.py); combined by the next norm
        if cfg.is_moe_layer(i):
            return x, ("dense", self._moe(i, w, h))
        return x, ("dense", self._dense_mlp(w, h))

    def _dense_mlp(self, w: dict, h):
        ops = self.ops
        return ops.linear(ops.swiglu(ops.linear(h, w["mlp_gate"]), ops.linear(h, w["mlp_up"])), w["mlp_down"])

    def _attend(self, n: int, i: int, x, token_slot, token_pos, residual=None, segments=None, rope_pos=None,
                tiles=None, project: bool = True, own_keys: bool = False):
        """A layer's first half: (x with the pending residual added, the attention's output projection; without
        ``project``, the attention's output (T, heads * head_dim) before it). ``own_keys`` (a decode step): the
        fused q | k | v's norm, RoPE and store may be the attention kernel's prologue (ops.rope_attention)."""
        ops, cfg, w = self.ops, self.cfg, self.layers[i]
        num_tokens = x.shape[0]
        hd, heads, kv_heads, eps = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        if self.fuse_qkv:
            rope = (heads, kv_heads, w["q_norm"], w["k_norm"], eps, token_slot, token_pos, self.cos, self.sin,
                    self.kv.k[n], self.kv.v[n])
            one_kernel = own_keys and segments is None and tiles is None and ops.takes_rope_attention(
                heads, w["q_norm"], w["k_norm"], self.cos, self.kv.k[n], cfg.sliding_window)
            if residual is not None and residual[0] == "normed":  # the projection normalizes x
                qkv = ops.linear_normed(x, residual[1], w["attn_norm"], eps, w["qkv"])
            else:
                x, h = self._residual_norm(x, residual, w["attn_norm"])
                qkv = ops.linear(h, w["qkv"]) if one_kernel else None
            if one_kernel:  # qkv_rope_store's work as the attention kernel's prologue
                a = ops.rope_attention(qkv, *rope, hd ** -0.5, cfg.sliding_window).reshape(num_tokens, heads * hd)
                return x, ops.linear(a, w["o"]) if project else a
            q = ops.qkv_rope_store(qkv, *rope) if qkv is not None else ops.linear_qkv_rope_store(h, w["qkv"], *rope)
        else:
            x, h = self._residual_norm(x, residual, w["attn_norm"])
            q = ops.linear(h, w["q"]).reshape(num_tokens, heads, hd)
            k = ops.linear(h, w["k"]).reshape(num_tokens, kv_heads, hd)
            v = ops.linear(h, w["v"]).reshape(num_tokens, kv_heads, hd)
            if cfg.qk_norm:
                q = ops.rmsnorm(q.reshape(num_tokens * heads, hd), w["q_norm"], eps).reshape(num_tokens, heads, hd)
                k = ops.rmsnorm(k.reshape(num_tokens * kv_heads, hd), w["k_norm"], eps).reshape(num_tokens, kv_heads, hd)
            if rope_pos is not None:  # M-RoPE: a position per axis (Qwen3-VL)
                q = ops.mrope(q, rope_pos, self.mrope_axes, self.cos, self.sin)
                k = ops.mrope(k, rope_pos, self.mrope_axes, self.cos, self.sin)
            else:
                q = ops.rope(q, token_pos, self.cos, self.sin)
                k = ops.rope(k, token_pos, self.cos, self.sin)
            ops.kv_store(self.kv.k[n], self.kv.v[n], k, v, token_slot, token_pos)
        a = ops.attention(q, self.kv.k[n], self.kv.v[n], token_slot, token_pos, hd ** -0.5, cfg.sliding_window,
                          segments=segments, tiles=tiles).reshape(num_tokens, heads * hd)
        return x, ops.linear(a, w["o"]) if project else a

    def _prefetch(self):
        """The expert cache's prefetch of the next layer's experts on cuda (workers/prefetch.py), or None."""
        return getattr(self.experts, "prefetch", None) if self.ops.name == "cuda" else None

    def _moe_routed(self, layer: int, w: dict, x, a, placement, expert_ids, prefetch=None):
        """Decode: the o projection of the attention's output ``a``, then residual add, MLP norm, router,
        top-k and pair tables (linear_norm_route: norm_route after the projection, or begun inside it), the
        router's choices going through the placement table on the device; experts that are not
        resident are read from the (mapped) host store by the kernels themselves. Where the backend
        ``routes_experts`` (cuda: FP8 o projection, quantized experts, no prefetch), the gate|up GEMV
        ends the routing itself (linear_route_experts); where it ``combines_experts`` (one token, quantized experts),
        the down GEMV ends in the combine and the residual add (expert_ffn_combine, with the prefetch too: a cache
        that holds a quarter of the experts gives the bits of one that holds them all). Returns (x, the layer's
        pending MoE output)."""
        ops, cfg = self.ops, self.cfg
        row = self.experts.store.row_of_layer[layer]
        store, arena, layout = self.experts.store.device_blobs, self.experts.array, self.experts.store.layout
        num_tokens = a.shape[0]
        tiles = self.experts.decode_tiles(num_tokens) and groups_in_decode(ops, self.experts, num_tokens * cfg.top_k,
                                                                           cfg.num_experts)
        if not tiles and prefetch is None and ops.routes_experts(a, w["o"], x, w["mlp_norm"], w["router"], cfg.top_k,
                                                                 arena, store, layout):
            route = (a, w["o"], x, w["mlp_norm"], cfg.rms_norm_eps, w["router"], cfg.top_k, cfg.norm_topk_prob,
                     placement, row, expert_ids[row], arena, store, layout)
            if ops.combines_experts(a, cfg.top_k, arena, store, layout, early=False):  # and the down the combine
                x, square, _ = ops.linear_route_experts(*route, None)
                return x, ("normed", square)
            out = ops.empty((num_tokens * cfg.top_k, cfg.hidden_size), np.float32)  # the gate|up ends the routing
            x, out, weights = ops.linear_route_experts(*route, out)
            return x, ("moe", out, weights)
        x, h, _, weights, pair_token, pair_slot, pair_out = ops.linear_norm_route(
            a, w["o"], x, w["mlp_norm"], cfg.rms_norm_eps, w["router"], cfg.top_k, cfg.norm_topk_prob, placement, row,
            expert_ids[row])
        keep = ()  # h while the side branch reads it: the next layer's recycle gives it back
        layers = self.experts.store.layers
        next_router = self.layers[layer + 1]["router"] if layers[row + 1:row + 2] == [layer + 1] else None
        if tiles:
            placement_row = placement[row]
            if prefetch is not None:  # this layer's copies in, then the next layer's on the side
                placement_row, keep = prefetch.around_tiles(ops, row, h, next_router, placement, store, arena)
            y_pair = grouped_moe_placed(ops, self.experts, h, expert_ids[row], placement_row, cfg.hidden_size,
                                        cfg.moe_intermediate_size, cfg.num_experts)  # many tokens: tensor cores
            if prefetch is not None:  # the next layer's copies, where they wait for these experts
                prefetch.after_experts(ops)
            return x, ("moe", y_pair, weights) + keep
        if prefetch is not None:
            keep = prefetch.around_experts(ops, row, pair_slot, h, next_router, placement, store, arena)
        if ops.combines_experts(h, cfg.top_k, arena, store, layout):  # the down GEMV ends in the combine
            x, square = ops.expert_ffn_combine(h, pair_token, pair_slot, pair_out, arena, layout, weights, x, store)
            pending = ("normed", square)  # the next norm takes 1 / rms from the squares
        else:
            out = ops.empty((h.shape[0] * cfg.top_k, cfg.hidden_size), np.float32)
            ops.expert_ffn(h, pair_token, pair_slot, pair_out, arena, cfg.hidden_size, cfg.moe_intermediate_size, out,
                           store=store, layout=layout)  # layout: quantized experts (None: bf16)
            pending = ("moe", out, weights)  # combined by the next norm (_residual_norm)
        if prefetch is not None:  # the next layer's copies, where they wait for these experts
            prefetch.after_experts(ops)
        return x, pending + keep

    def _moe(self, layer: int, w: dict, h):
        """Long steps (prefill): experts grouped on the host, misses copied into the cache first."""
        routed = self._route_on_host(layer, w, h, self.ops.empty)
        group = max(1, self.experts.num_slots)  # a cache smaller than the layer's experts: in groups
        for first in range(0, len(routed.unique), group):
            self._moe_group(layer, h, routed, first, min(first + group, len(routed.unique)))
        self.experts.release()
        return self.ops.combine(routed.out, routed.weights)

    def _route_on_host(self, layer: int, w: dict, h, allocate) -> "HostRouting":
        """The router's choices for a long step, on the host (its one round trip per layer), and the
        pair outputs' buffer from ``allocate`` (the step's scratch, or one that outlives the step)."""
        ops, cfg = self.ops, self.cfg
        num_tokens, top_k = h.shape[0], cfg.top_k
        ids, weights = ops.topk_softmax(ops.linear(h, w["router"]), top_k, cfg.norm_topk_prob)
        pair_expert = ops.to_host(ids).ravel()
        unique = np.unique(pair_expert)
        return HostRouting(weights=weights, unique=unique, pair_group_index=np.searchsorted(unique, pair_expert),
                           pair_token=np.repeat(np.arange(num_tokens, dtype=np.int32), top_k),
                           out=allocate((num_tokens * top_k, cfg.hidden_size), np.float32))

    def _moe_group(self, layer: int, h, routed: "HostRouting", first: int, end: int, experts=None) -> None:
        """The pairs of the experts ``routed.unique[first:end]`` into ``routed.out``: resident experts
        compute while missing ones are still being copied in; then the rest. ``experts``: what they
        are acquired from (a spanning chunk's staged cache, chunk_advance.chunk_experts; None: the cache)."""
        ops, cfg = self.ops, self.cfg
        experts = self.experts if experts is None else experts
        slots, ready = experts.acquire(layer, routed.unique[first:end])
        index = routed.pair_group_index
        members = np.nonzero((index >= first) & (index < end))[0]
        member_slot = slots[index[members] - first]
        member_ready = ready[index[members] - first]
        for is_ready in (True, False):
            pairs = members[member_ready == is_ready].astype(np.int32)
            if len(pairs) == 0:
                continue
            if not is_ready:
                experts.wait()
            pair_slot = member_slot[member_ready == is_ready]
            order = np.argsort(pair_slot, kind="stable")  # same expert back to back
            table = ops.upload(np.stack([routed.pair_token[pairs[order]], pair_slot[order], pairs[order]]))
            ops.expert_ffn(h, table[0], table[1], table[2], experts.array, cfg.hidden_size,
                           cfg.moe_intermediate_size, routed.out, layout=experts.store.layout)

    def _sample_output(self, batch: StepBatch, out: dict, want_logits: bool) -> StageOutput:
        return StageOutput(tokens=out["tokens"], logprobs=out["logprobs"], logits=out["logits"] if want_logits else None,
                           top_ids=out.get("top_ids"), top_logprobs=out.get("top_logprobs"))


@dataclass
class HostRouting:
    """A long step's routing for one layer, on the host, and its pair outputs (Stage._moe)."""
    weights: object  # (T, A) float32 on the device
    unique: np.ndarray  # the experts chosen, ascending
    pair_group_index: np.ndarray  # (T * A,) each pair's index into ``unique``
    pair_token: np.ndarray  # (T * A,) int32
    out: object  # (T * A, D) float32 pair outputs


def chunk_attention(cfg, device: str, kv_dtype: str) -> int:
    """Rows a tile of the chunk attention holds for this model, 0 where it is off (the decode kernel
    takes a chunk's rows). The setting MOEBUS_CHUNK_ATTENTION: tc (the default: tensor cores,
    attention_chunk_tc.py, where the cache is bf16 on a GPU; else off, as in the simulator; the cpu
    device checks its tables) or 0 (off); 1 (a numba tile kernel, 2.0-2.7x slower than the decode
    kernel) was removed in the eleventh session. On an H200 (48 x 32 A3B, tenth session) tc took a
    step of 8 decode rows + 16 at 8k context from 23.6 ms to 15.2 ms. Sliding-window models keep the
    decode kernel."""
    setting = os.environ.get("MOEBUS_CHUNK_ATTENTION", "tc")
    if setting not in ("0", "tc"):
        raise ValueError(f"MOEBUS_CHUNK_ATTENTION={setting!r}: tc or 0 (1, the numba tile kernel, was removed)")
    if setting == "0" or cfg.sliding_window:
        return 0
    from moebus.cuda.kernels import attention_chunk_tc

    group = cfg.num_heads // cfg.num_kv_heads
    rows = attention_chunk_tc.tile_rows(group)
    usable = kv_dtype == "bf16" and rows >= 2 and \
        (device == "cpu" or attention_chunk_tc.ready(cfg.head_dim, group, kv_dtype))
    return rows if usable else 0


def _segments(batch: StepBatch) -> list[tuple[int, int, int, int]]:
    """(first row, KV slot, start position, length) of each sequence of a step."""
    first_rows = np.cumsum(batch.lengths) - batch.lengths
    return [tuple(int(v) for v in seq) for seq in zip(first_rows, batch.slots, batch.starts, batch.lengths)]
