"""The cases of `moebus bench kernels` (kernels.py): each builds random inputs at one shape, uploads them, and returns
(run: launches the op once, check: (NMSE against the host reference, note), bytes the op must stream
or 0). Weights are bf16 as in the checkpoint; references that stream weights run in float64."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from moebus.cuda.memory.host_table import mapped_table
from moebus.cuda.kernels import (attention, elementwise, embedding, linear, moe, moe_ffn, rmsnorm, rope,
                                 sampling)
from moebus.cuda.kernels.compat import cuda
from moebus.cuda.dtypes import to_f32


@dataclass
class Case:
    op: str
    shape: str
    setup: Callable
    flops: float = 0.0  # of the op as written (the note gets TFLOP/s)


def _nmse(actual, expected) -> float:
    from moebus.bench.kernels import nmse

    return nmse(actual, expected)


def _dev(array, stream):
    return cuda.to_device(np.ascontiguousarray(array), stream=stream)


def _out(shape, stream, dtype=np.float32):
    return cuda.to_device(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype), stream=stream)


def _bf16(rng, *shape, scale=1.0):
    # truncated, not rounded: the references read the same bits back, and it is fast at 1e9 elements
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


@functools.lru_cache(maxsize=8)
def _shared_bf16(shape: tuple, scale: float) -> np.ndarray:
    """Large random weights made once and shared by the cases of every batch size (read only)."""
    array = _bf16(np.random.default_rng(len(shape) + shape[0]), *shape, scale=scale)
    array.flags.writeable = False
    return array


def _simple(op: str, shape: str, build) -> Case:
    """A case whose op writes one float32 output compared with one reference."""
    def setup(rng, stream):
        launch, out, ref = build(rng, stream)
        return launch, lambda: (_nmse(out.copy_to_host(), ref()), ""), 0
    return Case(op, shape, setup)


def linear_case(name: str, tokens: int, rows: int, cols: int) -> Case:
    def setup(rng, stream):
        x = rng.standard_normal((tokens, cols), dtype=np.float32)
        w = _shared_bf16((rows, cols), cols ** -0.5)
        dx, dw, out = _dev(x, stream), _dev(w, stream), _out((tokens, rows), stream)
        ref = lambda: x.astype(np.float64) @ to_f32(w).astype(np.float64).T  # noqa: E731
        return (lambda: linear.linear_cuda(dx, dw, out, stream=stream),
                lambda: (_nmse(out.copy_to_host(), ref()), ""), w.nbytes)
    return Case(f"linear {name}", f"T={tokens} {rows}x{cols} bf16", setup)


def gemm_case(name: str, tokens: int, rows: int, cols: int) -> Case:
    """x (T, cols) @ W (rows, cols)^T on tensor cores (gemm.py: split-bf16 x, two products); under
    the simulator the cuBLAS calls run on numpy (HostBlas)."""
    def setup(rng, stream):
        from moebus.cuda.backends.cuda import CudaBackend
        from moebus.cuda.kernels.compat import SIMULATOR
        from moebus.cuda.kernels.gemm import TensorCores
        from moebus.cuda.kernels.gemm_host import HostBlas, cublas_blas

        ops = CudaBackend()
        ops.stream = stream
        tensor_cores = TensorCores(HostBlas() if SIMULATOR else cublas_blas(), min_rows=1)
        x = rng.standard_normal((tokens, cols), dtype=np.float32)
        w = _shared_bf16((rows, cols), cols ** -0.5)
        dx, dw, out = _dev(x, stream), _dev(w, stream), _out((tokens, rows), stream)
        ref = lambda: x.astype(np.float64) @ to_f32(w).astype(np.float64).T  # noqa: E731

        def run():
            ops.device_pool.recycle()  # the split parts' buffer serves every launch (one stream: in order)
            tensor_cores.linear(ops, dx, dw, out)
        return run, lambda: (_nmse(out.copy_to_host(), ref()), ""), w.nbytes
    return Case(f"gemm {name}", f"T={tokens} {rows}x{cols} bf16", setup, flops=2.0 * tokens * rows * cols)


def expert_case(s: dict, tokens: int) -> Case:
    d, inter, e, k = s["hidden"], s["inter"], s["experts"], s["top_k"]

    def setup(rng, stream):
        x = rng.standard_normal((tokens, d), dtype=np.float32)
        arena = _shared_bf16((e, 3 * inter * d), d ** -0.5)
        experts = np.argsort(rng.random((tokens, e)), axis=1)[:, :k].ravel()  # distinct per token
        order = np.argsort(experts, kind="stable")  # as the stage sorts pairs by slot
        table = [np.ascontiguousarray(a, dtype=np.int32) for a in (order // k, experts[order], order)]
        dx, da = _dev(x, stream), _dev(arena, stream)
        dt = [_dev(a, stream) for a in table]
        out, scratch = _out((tokens * k, d), stream), _out((tokens * k, inter), stream)

        def check():
            ref = np.zeros((tokens * k, d), np.float64)
            for slot in np.unique(table[1]):
                rows = table[1] == slot
                gate, up, down = (to_f32(m).astype(np.float64) for m in moe.expert_blob_views(arena, slot, d, inter))
                xs = x[table[0][rows]].astype(np.float64)
                g = xs @ gate.T
                ref[table[2][rows]] = (g / (1 + np.exp(-g)) * (xs @ up.T)) @ down.T
            return _nmse(out.copy_to_host(), ref), f"{len(np.unique(experts))} experts"
        nbytes = len(np.unique(experts)) * arena.shape[1] * 2
        return (lambda: moe_ffn.expert_ffn_cuda(dx, *dt, da, d, inter, out, scratch, stream=stream), check, nbytes)
    return Case("expert_ffn", f"T={tokens} x{k} of {e}, {d}/{inter}", setup)


def attention_case(s: dict, label: str, slots: np.ndarray, positions: np.ndarray) -> Case:
    h, kvh, hd, ctx = s["heads"], s["kv_heads"], s["head_dim"], s["context"]
    tokens = len(positions)

    def setup(rng, stream):
        num_slots = int(slots.max()) + 1
        k_cache = rng.standard_normal((num_slots, kvh, ctx, hd), dtype=np.float32)
        v_cache = rng.standard_normal((num_slots, kvh, ctx, hd), dtype=np.float32)
        q = rng.standard_normal((tokens, h, hd), dtype=np.float32)
        args = [_dev(a, stream) for a in (q, k_cache, v_cache, slots.astype(np.int32), positions.astype(np.int32))]
        out = _out(q.shape, stream)
        scratch = _out(attention.attention_scratch_shape(tokens, h, hd, ctx), stream)
        ref = lambda: attention.attention_ref(q, k_cache, v_cache, slots, positions, hd ** -0.5)  # noqa: E731
        # K and V of every position each sequence reads, once per sequence
        lengths = [int(positions[slots == sl].max()) + 1 for sl in np.unique(slots)]
        nbytes = sum(lengths) * kvh * hd * 4 * 2
        done = _dev(np.zeros(tokens * kvh, np.int32), stream)  # the backend's counters: the splits merged in one launch
        return (lambda: attention.attention_cuda(*args, hd ** -0.5, 0, out, scratch, stream=stream, done=done),
                lambda: (_nmse(out.copy_to_host(), ref()), ""), nbytes)
    return Case("attention", label, setup)


def sample_case(s: dict, rows: int, greedy: bool) -> Case:
    vocab = s["vocab"]

    def setup(rng, stream):
        logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 3
        params = [np.full(rows, 0.0 if greedy else 0.8, np.float32), np.full(rows, 0 if greedy else 50, np.int32),
                  np.full(rows, 1.0 if greedy else 0.9, np.float32), rng.random(rows, dtype=np.float32)]
        args = [_dev(a, stream) for a in [logits] + params]
        tokens, logprobs, scratch = _out(rows, stream, np.int32), _out(rows, stream), _out((rows, vocab), stream)

        def check():
            ref_tokens, ref_logprobs = sampling.sample_ref(logits, *params)
            same = float(np.mean(tokens.copy_to_host() == ref_tokens))
            return _nmse(logprobs.copy_to_host(), ref_logprobs), f"{same:.0%} same tokens"
        return (lambda: sampling.sample_cuda(*args, tokens, logprobs, scratch, stream=stream), check, 0)
    return Case("sample " + ("greedy" if greedy else "t0.8 k50 p0.9"), f"S={rows} V={vocab}", setup)


def topk_case(s: dict, tokens: int) -> Case:
    def setup(rng, stream):
        logits = rng.standard_normal((tokens, s["experts"]), dtype=np.float32)
        ids, weights = _out((tokens, s["top_k"]), stream, np.int32), _out((tokens, s["top_k"]), stream)
        dl = _dev(logits, stream)

        def check():
            ref_ids, ref_weights = moe.topk_softmax_ref(logits, s["top_k"], True)
            same = float(np.mean(ids.copy_to_host() == ref_ids))
            return _nmse(weights.copy_to_host(), ref_weights), f"{same:.0%} same ids"
        return (lambda: moe.topk_softmax_cuda(dl, s["top_k"], True, ids, weights, stream=stream), check, 0)
    return Case("topk_softmax", f"T={tokens} E={s['experts']} k={s['top_k']}", setup)


def _elementwise_cases(s: dict, t: int) -> list[Case]:
    d, h, kvh, hd = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"]

    def rms(rows, dim):
        def build(rng, stream):
            x, w = rng.standard_normal((rows, dim), dtype=np.float32), _bf16(rng, dim)
            dx, dw, out = _dev(x, stream), _dev(w, stream), _out((rows, dim), stream)
            return (lambda: rmsnorm.rmsnorm_cuda(dx, dw, 1e-6, out, stream=stream), out,
                    lambda: rmsnorm.rmsnorm_ref(x, w, 1e-6))
        return build

    def binary(op, ref_op, cols):
        def build(rng, stream):
            a, b = (rng.standard_normal((t, cols), dtype=np.float32) for _ in range(2))
            da, db, out = _dev(a, stream), _dev(b, stream), _out((t, cols), stream)
            return lambda: op(da, db, out, stream=stream), out, lambda: ref_op(a, b)
        return build

    def embed(rng, stream):
        table, ids = _shared_bf16((s["vocab"], d), 1.0), rng.integers(0, s["vocab"], t).astype(np.int32)
        dt, di, out = _dev(table, stream), _dev(ids, stream), _out((t, d), stream)
        return lambda: embedding.embedding_cuda(dt, di, out, stream=stream), out, lambda: embedding.embedding_ref(table, ids)

    def embed_host(rng, stream):  # the table as a worker keeps it: mapped host memory (memory/host_table.py)
        table, ids = _shared_bf16((s["vocab"], d), 1.0), rng.integers(0, s["vocab"], t).astype(np.int32)
        dt, di, out = mapped_table(table), _dev(ids, stream), _out((t, d), stream)
        return lambda: embedding.embedding_cuda(dt, di, out, stream=stream), out, lambda: embedding.embedding_ref(table, ids)

    def rotary(rng, stream):
        cos, sin = rope.rope_tables(hd, 1e6, s["context"])
        x, pos = rng.standard_normal((t, h, hd), dtype=np.float32), rng.integers(0, s["context"], t).astype(np.int32)
        args, out = [_dev(a, stream) for a in (x, pos, cos, sin)], _out((t, h, hd), stream)
        return lambda: rope.rope_cuda(*args, out, stream=stream), out, lambda: rope.rope_ref(x, pos, cos, sin)

    def kv(rng, stream):
        cache = np.zeros((8, kvh, s["context"], hd), np.float32)
        k = rng.standard_normal((t, kvh, hd), dtype=np.float32)
        slots, pos = (np.arange(t) % 8).astype(np.int32), (np.arange(t) // 8).astype(np.int32)
        dk, dv = _dev(cache, stream), _dev(cache, stream)
        args = [_dev(a, stream) for a in (k, k, slots, pos)]

        def ref():
            expected = cache.copy()
            attention.kv_store_ref(expected, expected.copy(), k, k, slots, pos)
            return expected
        return lambda: attention.kv_store_cuda(dk, dv, *args, stream=stream), dk, ref

    def combine(rng, stream):
        y, w = rng.standard_normal((t * s["top_k"], d), dtype=np.float32), rng.random((t, s["top_k"]), dtype=np.float32)
        dy, dw, out = _dev(y, stream), _dev(w, stream), _out((t, d), stream)
        return lambda: moe.combine_cuda(dy, dw, out, stream=stream), out, lambda: moe.combine_ref(y, w)

    return [_simple("embedding", f"T={t} V={s['vocab']}", embed),
            _simple("embedding host", f"T={t} V={s['vocab']}", embed_host), _simple("rmsnorm", f"{t}x{d}", rms(t, d)),
            _simple("rmsnorm q-heads", f"{t * h}x{hd}", rms(t * h, hd)),
            _simple("add", f"{t}x{d}", binary(elementwise.add_cuda, elementwise.add_ref, d)),
            _simple("swiglu", f"{t}x{s['inter']}", binary(elementwise.swiglu_cuda, elementwise.swiglu_ref, s["inter"])),
            _simple("rope q", f"{t}x{h}x{hd}", rotary), _simple("kv_store", f"T={t}", kv),
            _simple("combine", f"T={t} k={s['top_k']}", combine)]


def _fused_cases(s: dict, t: int) -> list[Case]:
    """The decode path's fused kernels and the device-side routing (fused.py, routing.py, norm_route.py)."""
    from moebus.cuda.kernels import fused, routing
    from moebus.cuda.kernels.norm_route import norm_route_cuda, norm_route_ref

    d, h, kvh, hd, k = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["top_k"]

    def add_norm(rng, stream):
        x, y, w = rng.standard_normal((t, d), dtype=np.float32), rng.standard_normal((t, d), dtype=np.float32), _bf16(rng, d)
        args, total, out = [_dev(a, stream) for a in (x, y, w)], _out((t, d), stream), _out((t, d), stream)
        return (lambda: fused.add_rmsnorm_cuda(*args, 1e-6, total, out, stream=stream), out,
                lambda: fused.add_rmsnorm_ref(x, y, w, 1e-6)[1])

    def combine_norm(rng, stream):
        y, wk = rng.standard_normal((t * k, d), dtype=np.float32), rng.random((t, k), dtype=np.float32)
        x, w = rng.standard_normal((t, d), dtype=np.float32), _bf16(rng, d)
        args, total, out = [_dev(a, stream) for a in (y, wk, x, w)], _out((t, d), stream), _out((t, d), stream)
        return (lambda: fused.combine_add_rmsnorm_cuda(*args, 1e-6, total, out, stream=stream), out,
                lambda: fused.combine_add_rmsnorm_ref(y, wk, x, w, 1e-6)[1])

    def qkv(rng, stream):
        cos, sin = rope.rope_tables(hd, 1e6, s["context"])
        x = rng.standard_normal((t, (h + 2 * kvh) * hd), dtype=np.float32)
        qw, kw = _bf16(rng, hd), _bf16(rng, hd)
        slots, pos = np.arange(t, dtype=np.int32), np.full(t, s["context"] - 1, np.int32)
        cache = np.zeros((t, kvh, s["context"], hd), np.float32)
        args = [_dev(a, stream) for a in (x,)] + [h, kvh] + [_dev(a, stream) for a in (qw, kw)] + [1e-6] + \
            [_dev(a, stream) for a in (slots, pos, cos, sin, cache, cache)]
        out = _out((t, h, hd), stream)
        return (lambda: fused.qkv_rope_store_cuda(*args, out, stream=stream), out,
                lambda: fused.qkv_rope_store_ref(x, h, kvh, qw, kw, 1e-6, slots, pos, cos, sin, cache.copy(),
                                                 cache.copy()))

    def route(rng, stream):
        ids = np.stack([rng.permutation(s["experts"])[:k] for _ in range(t)]).astype(np.int32)
        table = rng.integers(-1000, 1000, size=(4, s["experts"])).astype(np.int32)
        di, dt = _dev(ids, stream), _dev(table, stream)
        outs = [_out((t * k,), stream, np.int32) for _ in range(3)]
        return (lambda: routing.route_pairs_cuda(di, dt, 2, *outs, stream=stream), outs[1],
                lambda: routing.route_pairs_ref(ids, table, 2)[1])

    def norm_route(rng, stream):
        # decode's MLP entry: add + rmsnorm + router + top-k + pair tables, one launch (compared: h)
        x, y = (rng.standard_normal((t, d), dtype=np.float32) for _ in range(2))
        w = _bf16(rng, d)
        router = _bf16(rng, s["experts"], d, scale=d ** -0.5)
        table = rng.integers(-1000, 1000, size=(4, s["experts"])).astype(np.int32)
        args = [_dev(a, stream) for a in (x, y, w)] + [1e-6, _dev(router, stream), k, True, _dev(table, stream), 2,
                                                        _dev(np.zeros(1, np.int32), stream)]
        outs = [_out((t, d), stream), _out((t, d), stream), _out((t, k), stream, np.int32), _out((t, k), stream)] + \
            [_out((t * k,), stream, np.int32) for _ in range(3)]
        scratch = _out((t, s["experts"]), stream)  # the logits: the router's rows over blocks, as the backend runs it
        return (lambda: norm_route_cuda(*args, *outs, stream=stream, scratch=scratch), outs[1],
                lambda: norm_route_ref(x, y, w, 1e-6, router, k, True, table, 2)[1])

    cases = [_simple("add_rmsnorm", f"{t}x{d}", add_norm), _simple("combine_add_rmsnorm", f"T={t} k={k}", combine_norm),
             _simple("route_pairs", f"T={t} k={k}", route),
             _simple("norm_route", f"T={t} E={s['experts']} k={k}", norm_route)]
    if fused.can_fuse_heads(hd):
        cases.append(_simple("qkv_rope_store", f"T={t}", qkv))
    return cases


def make_cases(s: dict) -> list[Case]:
    """Decode batch 1 first, then batch 8, then prefill: if the deadline cuts the run, what is left
    out is the least interesting."""
    d, h, kvh, hd, v = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["vocab"]
    cases = []
    for t in (*s["decode"], s["prefill"]):
        cases += [linear_case("qkv", t, (h + 2 * kvh) * hd, d), linear_case("q", t, h * hd, d),
                  linear_case("k/v", t, kvh * hd, d), linear_case("o", t, d, h * hd),
                  linear_case("router", t, s["experts"], d), expert_case(s, t), topk_case(s, t)]
        if t in s["decode"]:
            positions = np.full(t, s["context"] - 1)
            cases += [attention_case(s, f"decode B={t} ctx={s['context']}", np.arange(t), positions),
                      linear_case("lm_head", t, v, d), sample_case(s, t, True), sample_case(s, t, False)]
        else:
            cases.append(attention_case(s, f"prefill T={t}", np.zeros(t, np.int64), np.arange(t)))
            for tokens in (t, 4 * t, 16 * t):  # tensor cores: 512, 2048, 8192 rows at the real shapes
                cases += [gemm_case("qkv", tokens, (h + 2 * kvh) * hd, d), gemm_case("o", tokens, d, h * hd),
                          gemm_case("expert gate|up", tokens, 2 * s["inter"], d),
                          gemm_case("expert down", tokens, d, s["inter"])]
        cases += _elementwise_cases(s, t)
        if t in s["decode"]:
            cases += _fused_cases(s, t)
    return cases
