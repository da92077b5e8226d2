"""Decode attention on tensor cores (attention_decode_tc.cu; fifteenth session): attention.attention_cuda
takes this split kernel where ``takes`` says so (bf16, hd 128, a group of <= 8 heads, no window, a GPU and
a stream object; attention_decode.DECODE_TC, on by default) and merges apart (attention_decode.merge_splits);
elsewhere the numba kernel of attention_decode.py. Why: the numba kernel spends ~120 PTX instructions
a cache row on CUDA cores (64 of them FMAs: 8 query heads x 128 dims x 2 / 32 lanes), so at 32k context
it is bound by issue, not by HBM; on mma.sync the group's 8 heads take a row in a few instructions.

The split kernel writes the decode scratch's partials (attention.attention_scratch_shape) for the splits
attention_decode.splitter cuts (DECODE_SPLITS, TC_SPLIT_POSITIONS: the merge is told the same). Given
counters and the output (attention_decode.TC_MERGE_IN_SPLIT, sixteenth session: on where a token of the cache has
at most TC_MERGE_MAX_SPLITS splits, attention.merges_in_split) it merges too, in one launch a layer: a token of
one split writes its output directly, else the last split block of a (token, kv head) merges as merge_splits
does (the same bits; at most MERGE_CAP splits; slower than apart at many splits: 35.2 against 28.2 us at 32k).
With attention_decode.TC_PDL (sixteenth session, on) every block waits first (griddepcontrol.wait, then the
trigger) and the entry is PDL_ENTRY, registered with pdl.register_waiting: a captured graph's edge into it
becomes programmatic, as into the numba kernels (without it, a full edge: the one kernel a layer that PDL did
not reach). Both: b1 on M48 3.267 -> 3.186 ms a step (sixteenth session, call A). H200, b1,
the 48 x 32 a3b shapes, attention alone (split + merge): 1k / 4k / 32k 9.7 / 17.6 / 34.2 us (32k: 1.96 TB/s)
against the numba kernel's 18.0 / 32.0 / 58.1, error 2.2e-11 (tools/device/decode15.sh; the merge then
loaded 4 splits at a time, now MERGE_APART_SPLITS). Its reference is attention_ref through the merge; the
simulator keeps the numba kernel.

``launch_rope`` (twenty-third session; attention.rope_attention_cuda, ROPE_ATTENTION): the same kernel built with
ROPE takes the fused q | k | v projection's row and does fused.qkv_rope_store's work for its (token, kv head) as its
prologue (the group's q heads into shared memory, the token's k and v into the caches and its own key from shared
memory), so the decode's qkv_rope_store kernel leaves the chain; ROPE_EARLY_KV: the token's place read and its
first keys' lines prefetched before the PDL wait (the step's inputs: copied before the graph launches)."""
from __future__ import annotations

import functools
from pathlib import Path

import logging

import numpy as np

from moebus.cuda.kernels import flash_attention, pdl
from moebus.cuda.kernels.compat import SIMULATOR

SOURCE = Path(__file__).with_suffix(".cu")
INCLUDE = b'#include "flash_attention.cu"'
ENTRY = "decode_attention_tc"
PDL_ENTRY = "decode_attention_tc_pdl"  # the kernel that waits first (attention_decode.TC_PDL): its own name
ROPE_ENTRY, ROPE_PDL_ENTRY = "decode_rope_attention_tc", "decode_rope_attention_tc_pdl"  # ROPE's (launch_rope)
ROPE_EARLY_KV = True  # ROPE: the token's place and its first keys' L1 prefetch before the PDL wait
HEAD_DIM = 128
WARPS = 4  # a block's warps (4 or 8), each on its own 16-key tiles
MIN_BLOCKS = 2  # blocks an SM holds (launch bounds: 198 registers at 4 warps, no spills)
MERGE_CAP = 256  # splits the in-kernel merge takes at most (its weights: 8 x MERGE_CAP floats of shared memory)
log = logging.getLogger("moebus.cuda")


def source() -> bytes:
    """This .cu with flash_attention's source (its device functions) in place of its #include."""
    main = SOURCE.read_bytes()
    if INCLUDE not in main:
        raise RuntimeError(f"{SOURCE.name} lacks {INCLUDE.decode()}")
    return main.replace(INCLUDE, flash_attention.source(), 1)


def entry_name(wait: bool, rope: bool = False) -> str:
    return (ROPE_PDL_ENTRY if wait else ROPE_ENTRY) if rope else (PDL_ENTRY if wait else ENTRY)


def compile_options(arch: str, warps: int, min_blocks: int, wait: bool = False, rope: bool = False,
                    early_kv: bool = False) -> list[bytes]:
    """``wait``: every block waits first (griddepcontrol.wait; then releases its dependents where
    pdl.trigger_after_wait), the entry PDL_ENTRY. ``rope``: the ROPE build (launch_rope), ``early_kv`` its
    reads of the step's inputs and prefetch before the wait; its entries ROPE_ENTRY / ROPE_PDL_ENTRY."""
    pdl_options = [b"-DTC_PDL=1", f"-DPDL_TRIGGER={int(pdl.trigger_after_wait())}".encode()] if wait else []
    rope_options = [b"-DROPE=1", f"-DEARLY_KV={int(bool(early_kv))}".encode()] if rope else []
    entry = [f"-DTC_ENTRY={entry_name(wait, rope)}".encode()] if wait or rope else []
    return flash_attention.compile_options(HEAD_DIM, False, arch) + [f"-DDWARPS={int(warps)}".encode(),
                                                                    f"-DMIN_BLOCKS_TC={int(min_blocks)}".encode(),
                                                                    f"-DMERGE_CAP={MERGE_CAP}".encode()] + \
        pdl_options + rope_options + entry


def cubin(arch: str, warps: int, min_blocks: int, cache_dir: str | None, wait: bool = False, rope: bool = False,
          early_kv: bool = False) -> bytes:
    """The cubin for ``arch``, from ``cache_dir``/attention_decode_tc when compiled before (the name hashes
    the source, the options and NVRTC's version), else NVRTC's, then kept there."""
    options = compile_options(arch, warps, min_blocks, wait, rope, early_kv)
    return flash_attention.cached_cubin(source(), options, cache_dir, "attention_decode_tc")


@functools.cache
def _kernel(warps: int, min_blocks: int, wait: bool = False, rope: bool = False, early_kv: bool = False):
    from moebus.cuda.kernels.compat import _numba_config, cuda

    gpu = cuda.get_current_device()
    flash_attention._core_device(gpu.id).set_current()  # the primary context, numba's own
    major, minor = gpu.compute_capability
    code = cubin(f"sm_{major}{minor}", warps, min_blocks, _numba_config.CACHE_DIR, wait, rope, early_kv)
    entry = entry_name(wait, rope)
    found = flash_attention._object_code().from_cubin(code, name=f"{entry}_w{warps}").get_kernel(entry)
    if wait:
        pdl.register_waiting(entry.encode(), *_handles(found))
    return found


def _handles(found) -> list[int]:
    """The kernel's handle and its function in the current context (ints): how a graph's kernel node may name
    it (pdl.make_programmatic also matches by entry name)."""
    handles = []
    try:
        from cuda.bindings import driver as cu

        handles.append(int(found.handle))
        status, function = cu.cuKernelGetFunction(found.handle)
        if status == cu.CUresult.CUDA_SUCCESS:
            handles.append(int(function))
    except Exception:  # noqa: BLE001 - the entry name still matches
        pass
    return handles


def takes(storage: str, head_dim: int, group: int, stream) -> bool:
    """Whether this kernel takes a decode attention: a bf16 cache of hd 128, at most 8 heads a kv head, a
    GPU (not the simulator), a stream object (a cuda.core launch; not the default stream 0), the kernel
    built (a failure warns once: the numba kernel takes it)."""
    return (storage == "bf16" and head_dim == HEAD_DIM and group <= 8 and not SIMULATOR
            and (hasattr(stream, "__cuda_stream__") or hasattr(stream, "end_building"))
            and _builds(WARPS, MIN_BLOCKS, _waits()))


def _waits() -> bool:
    """attention_decode.TC_PDL: the kernel that waits first (a no-op wait where no edge is programmatic)."""
    from moebus.cuda.kernels import attention_decode

    return bool(attention_decode.TC_PDL)


def _tight_grid() -> bool:
    """attention_decode.TC_GRID_SPLITS: the grid's splits the most a token can have in this cache, not the scratch's."""
    from moebus.cuda.kernels import attention_decode

    return bool(attention_decode.TC_GRID_SPLITS)


@functools.cache
def _builds(warps: int, min_blocks: int, wait: bool = False, rope: bool = False, early_kv: bool = False) -> bool:
    try:
        _kernel(warps, min_blocks, wait, rope, early_kv)
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: the numba kernel still works
        log.warning("decode attention on tensor cores unavailable (%s)", exc)
        return False
    return True


def launch(q, k_cache, v_cache, token_slot, token_pos, scale: float, scratch, stream, decode_splits: int,
           split_positions: int, warps: int = 0, min_blocks: int = 0, done=None, out=None) -> None:
    """The partials of every token's splits (at most ``decode_splits`` of at least ``split_positions``
    positions, [0, its position]) into ``scratch`` (T, H, splits, hd + 2). ``stream``: a numba stream or
    a GraphBuilder (not 0). With ``done`` (int32 counters at 0, at least T * KVH; left at 0) and ``out``
    (T, H, hd) float32, the splits merged into ``out`` too (merge_splits' bits; no partials where a token
    has one split)."""
    _launch(q.shape, q, None, k_cache, v_cache, token_slot, token_pos, scale, scratch, stream, decode_splits,
            split_positions, warps, min_blocks, done, out)


def takes_rope(q_weight, k_weight, cos) -> bool:
    """Whether launch_rope takes these (``takes`` as well): bf16 norm weights of HEAD_DIM, a float32 table of
    HEAD_DIM / 2 columns, the ROPE build loads."""
    return (q_weight.dtype == np.uint16 and k_weight.dtype == np.uint16 and q_weight.shape == (HEAD_DIM,)
            and k_weight.shape == (HEAD_DIM,) and cos.dtype == np.float32 and cos.ndim == 2
            and cos.shape[1] == HEAD_DIM // 2 and _builds(WARPS, MIN_BLOCKS, _waits(), True, bool(ROPE_EARLY_KV)))


def launch_rope(qkv, heads: int, q_weight, k_weight, eps: float, cos, sin, k_cache, v_cache, token_slot, token_pos,
                scale: float, scratch, stream, decode_splits: int, split_positions: int, done=None, out=None) -> None:
    """fused.qkv_rope_store's work (qkv (T, (H + 2 KVH) hd) float32: the fused projection; q_weight, k_weight (hd,)
    bf16; cos, sin (positions, hd / 2) float32; the token's k and v into the caches) and then ``launch``'s, in one
    kernel: the q it would have written never leaves the block."""
    rope = (qkv, q_weight, k_weight, np.float32(eps), cos, sin)
    _launch((qkv.shape[0], int(heads), HEAD_DIM), None, rope, k_cache, v_cache, token_slot, token_pos, scale, scratch,
            stream, decode_splits, split_positions, 0, 0, done, out)


def _launch(shape, q, rope, k_cache, v_cache, token_slot, token_pos, scale: float, scratch, stream,
            decode_splits: int, split_positions: int, warps: int, min_blocks: int, done, out) -> None:
    warps, min_blocks = warps or WARPS, min_blocks or MIN_BLOCKS
    if (done is None) != (out is None):
        raise ValueError("the merge in the split kernel takes both the counters and the output")
    num_tokens, heads, head_dim = shape
    slots, kv_heads, context, _ = k_cache.shape
    if head_dim != HEAD_DIM or heads // kv_heads > 8 or heads % kv_heads or k_cache.dtype != np.uint16:
        raise ValueError(f"the tensor-core decode takes bf16 caches of hd {HEAD_DIM}, up to 8 heads a kv head")
    most_splits = min(decode_splits, -(-context // split_positions))
    if scratch.shape[2] < most_splits:
        raise ValueError(f"a scratch of {scratch.shape[2]} splits holds fewer than the tokens can have")
    if done is not None and (done.shape[0] < num_tokens * kv_heads or most_splits > MERGE_CAP):
        raise ValueError(f"the merge in the split kernel takes a counter a (token, kv head), {MERGE_CAP} splits")
    ptr = flash_attention._pointer
    grid_splits = most_splits if _tight_grid() else scratch.shape[2]  # blocks past a token's splits return at once
    null = np.intp(0)
    if rope is None:
        rope_args = (null, null, null, np.float32(0.0), null, null)
        kernel = _kernel(warps, min_blocks, _waits())
    else:
        qkv, q_weight, k_weight, eps, cos, sin = rope
        rope_args = (ptr(qkv), ptr(q_weight), ptr(k_weight), np.float32(eps), ptr(cos), ptr(sin))
        kernel = _kernel(warps, min_blocks, _waits(), True, bool(ROPE_EARLY_KV))
    flash_attention._core_launch(stream, (num_tokens, kv_heads, grid_splits), 32 * warps, kernel,
                                 null if q is None else ptr(q), ptr(k_cache), ptr(v_cache), ptr(scratch),
                                 ptr(token_slot), ptr(token_pos), np.int32(heads), np.int32(kv_heads),
                                 np.int32(context), np.int32(scratch.shape[2]), np.int32(decode_splits),
                                 np.int32(split_positions), np.float32(scale * np.log2(np.e)),
                                 *(null if a is None else ptr(a) for a in (done, out)), *rope_args)  # null: no merge
