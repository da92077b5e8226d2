"""The routing's end of one decode token in one CUDA C block (route_end.cu; twenty-third session), in place of
norm_route.route_tail_cuda's numba kernel after the o projection's ROUTE entry (linear_quant_mma.launch_route): the
same outputs with the same bits (route_tail_ref's arithmetic in route_tail's order), warp 0 ranking the experts by
shuffles and a ballot where route_tail's one_token_tail goes through shared memory and three block barriers.

``MOEBUS_ROUTE_END`` (default 1; ``0``: route_tail's kernel). Takes at most 32 experts (a lane an expert) or, with
``MOEBUS_ROUTE_END_WIDE`` (default 1; ``0``: route_tail's kernel above 32 experts), 128 (route_tail's topk_row + sort_pairs by ranks:
Qwen3-30B-A3B's 128), top_k <= 32, a hidden size of whole 16-row tiles and 4-float quads, a bf16 norm weight, a GPU
and a stream object; elsewhere route_tail."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np

from moebus.cuda.kernels import flash_attention, pdl
from moebus.cuda.kernels.compat import SIMULATOR

SOURCE = Path(__file__).with_suffix(".cu")
SUMS = Path(__file__).with_name("route_sums.cuh")  # route_tail's column sums, shared with moe_quant_mma.cu
INCLUDE = b'#include "route_sums.cuh"'
ENTRY = "route_end"
THREADS = 256
WIDE_THREADS = 1024  # WIDE (> 32 experts): the partials' (column, part) pairs (1,032 at 128) in one load round a thread
ENABLED = os.environ.get("MOEBUS_ROUTE_END", "1") != "0"
MAX_EXPERTS = 128  # a lane an expert up to 32, then 4 a lane (route_end.cu's WIDE: Qwen3-30B-A3B's 128)
# More than 32 experts (route_end.cu's WIDE): its first form (warp 0 ranking by shuffles) gave route_tail's bits on
# the H200 but took 10.2 us a layer against route_tail's 9.7 (twenty-fourth session); this form (a thread an expert
# ranking against shared memory) took 6.5 us against route_tail's 13.8 under Nsight Compute at 128 experts, the same
# bits (twenty-fifth session). MOEBUS_ROUTE_END_WIDE=0 keeps route_tail's kernel above 32 experts.
WIDE = os.environ.get("MOEBUS_ROUTE_END_WIDE", "1") != "0"
log = logging.getLogger("moebus.cuda")


def with_route_sums(text: bytes) -> bytes:
    """``text`` (a .cu) with route_sums.cuh in place of its #include (one text, so the cubin's name hashes both)."""
    if INCLUDE not in text:
        raise RuntimeError(f"the source lacks {INCLUDE.decode()}")
    return text.replace(INCLUDE, SUMS.read_bytes(), 1)


def source() -> bytes:
    return with_route_sums(SOURCE.read_bytes())


def threads_for(experts: int) -> int:
    return THREADS if experts <= 32 else WIDE_THREADS


def compile_options(arch: str, experts: int, dim: int, threads: int | None = None) -> list[bytes]:
    threads = threads_for(experts) if threads is None else threads
    if not (0 < experts <= MAX_EXPERTS and dim % 16 == 0 and dim > 0 and threads % 32 == 0):
        raise ValueError(f"route_end: 1 to {MAX_EXPERTS} experts ({experts}), whole 16-row tiles ({dim}), whole warps")
    return [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"-DEXPERTS={int(experts)}".encode(),
            f"-DDIM={int(dim)}".encode(), f"-DTHREADS={int(threads)}".encode(),
            f"-DPDL_TRIGGER={int(pdl.trigger_after_wait())}".encode(), f"-DENTRY={ENTRY}".encode()]


@functools.cache
def _kernel(experts: int, dim: int, threads: int):
    """The compiled kernel for this GPU, registered as waiting first (its edge in a captured graph programmatic)."""
    from moebus.cuda.kernels.attention_decode_tc import _handles
    from moebus.cuda.kernels.compat import _numba_config, cuda

    gpu = cuda.get_current_device()
    flash_attention._core_device(gpu.id).set_current()  # the primary context, numba's own
    major, minor = gpu.compute_capability
    options = compile_options(f"sm_{major}{minor}", experts, dim, threads)
    code = flash_attention.cached_cubin(source(), options, _numba_config.CACHE_DIR, "route_end")
    found = flash_attention._object_code().from_cubin(code, name=f"{ENTRY}_{experts}_{dim}_{threads}").get_kernel(ENTRY)
    pdl.register_waiting(ENTRY.encode(), *_handles(found))
    return found


@functools.cache
def _builds(experts: int, dim: int) -> bool:
    try:
        _kernel(experts, dim, threads_for(experts))
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: route_tail's kernel still works
        log.warning("route_end unavailable (%s): route_tail's kernel ends the routing", exc)
        return False
    return True


def takes(partial, total, norm_weight, top_k: int, stream) -> bool:
    """Whether ``launch`` runs (ENABLED and WIDE, read at each call): one token, at most 32 experts (MAX_EXPERTS with
    WIDE) and 32 chosen, whole tiles and quads, 16-byte aligned C-ordered partials and total, a bf16 norm weight, a
    GPU and a stream object, the kernel built."""
    from moebus.cuda.kernels.compat import is_contiguous
    from moebus.cuda.kernels.moe_quant_mma import _stream_object
    from moebus.cuda.kernels.moe_quant_round import aligned

    num_experts, dim = partial.shape[1] - 1, total.shape[1]
    return (ENABLED and not SIMULATOR and total.shape[0] == 1 and 0 < top_k <= min(num_experts, 32)
            and num_experts <= (MAX_EXPERTS if WIDE else 32) and dim % 16 == 0
            and partial.shape[0] == dim // 16 and norm_weight.dtype == np.uint16
            and all(map(is_contiguous, (partial, total, norm_weight))) and aligned(partial, total, norm_weight)
            and _stream_object(stream) and _builds(num_experts, dim))


def launch(partial, total, norm_weight, eps: float, top_k: int, normalize: bool, table, layer_row: int, h, ids,
           weights, pair_token, pair_slot, pair_out, stream):
    """norm_route.route_tail_cuda's outputs (h, ids, weights, pair_token, pair_slot, pair_out), its bits, one block."""
    from moebus.cuda.kernels.moe_quant_mma import _table_row

    num_experts, dim = partial.shape[1] - 1, total.shape[1]
    ptr = flash_attention._pointer
    threads = threads_for(num_experts)
    flash_attention._core_launch(stream, (1, 1), threads, _kernel(num_experts, dim, threads), ptr(partial),
                                 ptr(total), ptr(norm_weight), np.float32(eps), _table_row(table, layer_row),
                                 np.int32(top_k), np.int32(bool(normalize)), ptr(h), ptr(ids), ptr(weights),
                                 ptr(pair_token), ptr(pair_slot), ptr(pair_out))
    return h, ids, weights, pair_token, pair_slot, pair_out
