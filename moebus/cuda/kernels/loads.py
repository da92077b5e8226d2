"""Device-side reads of stored weights (bf16 bits in uint16, float16, float32) and of float32
activations, always converted to float32 in registers.

Two shapes of read:
- ``scalar(a, row, col)``: one element of a 2-D array.
- ``chunk(a, row, word, buf)``: ``WIDTH`` consecutive elements starting at ``word * WIDTH`` into the
  local array ``buf``. The *wide* chunk is 4 elements read as 8-byte words from a uint64 view of the
  array (one word for bf16/f16, two for f32), so a warp reading words ``lane, lane + 32, ...`` moves
  256 contiguous bytes per load; the *narrow* chunk (width 1) is the fallback for rows whose length
  or address is not a multiple of 4 elements / 8 bytes.

A kernel takes the array as ``reader_view(array, wide)`` gives it and counts its columns in words.
"""
from __future__ import annotations

import numpy as np

from moebus.cuda.kernels.compat import (SIMULATOR, WARP, bits_as_f32, cuda, data_ptr, device, float32, int64, is_contiguous,
                                        kernel, uint32)
from moebus.cuda.kernels.launch import ceil_div
from moebus.cuda.dtypes import storage_name

WIDE = 4  # elements per wide word
LO16 = np.uint64(0xFFFF)
HI16 = np.uint64(0xFFFF0000)
F16_MAG = np.uint64(0x7FFF)
F16_SIGN = np.uint64(0x8000)
F16_SCALE = np.float32(2.0**112)  # float32 exponent bias 127 - float16 bias 15


# -- scalar ---------------------------------------------------------------------------------------

@device
def load_bf16(a, row, col):
    return bits_as_f32(uint32(a[row, col]) << 16)


@device
def load_f16(a, row, col):
    return float32(a[row, col])


@device
def load_f32(a, row, col):
    return a[row, col]


# -- chunks ---------------------------------------------------------------------------------------

@device
def _f16_bits_to_f32(h):
    # exact for finite halves, subnormals included: place the half's exponent and mantissa in a
    # float32 (exponent now biased by 127 instead of 15) and rescale by 2^112; no intrinsic needed
    return bits_as_f32(((h & F16_MAG) << 13) | ((h & F16_SIGN) << 16)) * F16_SCALE


@device
def word_bf16(u, buf):
    """The 4 bf16 of one loaded 8-byte word ``u`` into buf (a kernel that loads its words early,
    before it converts them: norm_route.py's router)."""
    buf[0] = bits_as_f32((u & LO16) << 16)
    buf[1] = bits_as_f32(u & HI16)
    buf[2] = bits_as_f32((u >> 16) & HI16)
    buf[3] = bits_as_f32((u >> 32) & HI16)


@device
def word_f16(u, buf):
    buf[0] = _f16_bits_to_f32(u & LO16)
    buf[1] = _f16_bits_to_f32((u >> 16) & LO16)
    buf[2] = _f16_bits_to_f32((u >> 32) & LO16)
    buf[3] = _f16_bits_to_f32(u >> 48)


@device
def chunk_bf16(a, row, word, buf):
    word_bf16(a[row, word], buf)


@device
def chunk_f16(a, row, word, buf):
    word_f16(a[row, word], buf)


@device
def chunk_f32(a, row, word, buf):
    lo = a[row, 2 * word]
    hi = a[row, 2 * word + 1]
    buf[0] = bits_as_f32(lo)
    buf[1] = bits_as_f32(lo >> 32)
    buf[2] = bits_as_f32(hi)
    buf[3] = bits_as_f32(hi >> 32)


@device
def chunk1_bf16(a, row, word, buf):
    buf[0] = load_bf16(a, row, word)


@device
def chunk1_f16(a, row, word, buf):
    buf[0] = load_f16(a, row, word)


@device
def chunk1_f32(a, row, word, buf):
    buf[0] = a[row, word]


WORD = {"bf16": word_bf16, "f16": word_f16}  # storages whose 4 elements are one 8-byte word
SCALAR = {"bf16": load_bf16, "f16": load_f16, "f32": load_f32}
CHUNK = {("bf16", True): chunk_bf16, ("f16", True): chunk_f16, ("f32", True): chunk_f32,
         ("bf16", False): chunk1_bf16, ("f16", False): chunk1_f16, ("f32", False): chunk1_f32}


def chunk_reader(storage: str, wide: bool, streaming: bool = False):
    """(chunk device function, its width in elements). ``streaming``: bf16 / f16 wide words loaded
    with the evict-first policy (load_streaming), for weights read once a step."""
    if streaming and wide and storage in WORD:
        return STREAMING[storage], WIDE
    return CHUNK[(storage, wide)], (WIDE if wide else 1)


def can_read_wide(array, *row_lengths: int) -> bool:
    """Wide reads need C order, 8-byte aligned start and rows (and any sub-row offsets) of whole words."""
    return (is_contiguous(array) and data_ptr(array) % 8 == 0
            and all(n % WIDE == 0 for n in (array.shape[array.ndim - 1], *row_lengths)))


def reader_view(array, wide: bool):
    """The 2-D array a chunk reader takes: a uint64 view for wide reads, the array itself otherwise."""
    if array.ndim == 1:
        array = array.reshape(1, array.shape[0])
    return array.view(np.uint64) if wide else array


def storage_of(array) -> str:
    return storage_name(array)


# -- streaming loads ------------------------------------------------------------------------------

if SIMULATOR:
    def load_streaming(a, row, col):
        return a[row, col]
else:
    @device
    def load_streaming(a, row, col):
        """a[row, col] with the evict-first policy (ld.global.cs): weights read once a step (the
        experts, 75 MB a layer at batch 1) pass through the 50 MB L2 without pushing out the rest."""
        return cuda.ldcs(a, (int64(row), int64(col)))


@device
def chunk_bf16_streaming(a, row, word, buf):
    word_bf16(load_streaming(a, row, word), buf)


@device
def chunk_f16_streaming(a, row, word, buf):
    word_f16(load_streaming(a, row, word), buf)


STREAMING = {"bf16": chunk_bf16_streaming, "f16": chunk_f16_streaming}


# -- L2 warming from a side branch ----------------------------------------------------------------
# A weight matrix asked into L2 (cp.async.bulk.prefetch.L2, sm_90) by a kernel of its own on a second
# branch of the decode graph, spread over the SMs that the latency-bound kernels before its GEMV leave
# idle (stage.py: the o projection during the attention). decode7 issued the same prefetches from the
# latency-bound kernels' own threads, all from one SM, and stalled them (docs/performance.md).

L2_CHUNK_BYTES = 64 * 1024  # bytes one bulk prefetch asks for
WARM_CHUNKS_PER_BLOCK = 2  # prefetches a block issues (one a thread): the chunks spread over the SMs
WARM_O_PROJ = False  # stage.py: the o projection's weights, forked after the qkv GEMV
WARM_NEXT_QKV = False  # stage.py: the next layer's qkv weights, forked after norm_route
# stage.py: the routed experts' weights from their arena slots, forked after norm_route, while the
# expert GEMVs read them ("down": the down parts, "all": gate|up and down, "": none)
WARM_EXPERTS = ""


def l2_chunks(array) -> int:
    """How many bulk prefetches (L2_CHUNK_BYTES each, the last one shorter) cover ``array``."""
    return -(-int(array.nbytes) // L2_CHUNK_BYTES)


if SIMULATOR:
    def _prefetch_chunk(flat, offset, nbytes):
        """The simulator has no L2: nothing to warm."""
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _prefetch_chunk(typingctx, flat, offset, nbytes):
        """cp.async.bulk.prefetch.L2 of ``nbytes`` (a multiple of 16) at byte ``offset`` of a
        contiguous array: the bytes come into L2 while the thread goes on; nothing waits for them."""

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            address = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [args[1]])
            size = builder.trunc(args[2], ir.IntType(32))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32)]),
                               "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r,~{memory}", side_effect=True)
            builder.call(asm, [address, size])

        return types.void(flat, types.int64, types.int64), codegen


@kernel
def _l2_warm(flat, nbytes, num_chunks, per_block):
    chunk = cuda.blockIdx.x * per_block + cuda.threadIdx.x
    offset = int64(chunk) * L2_CHUNK_BYTES
    if cuda.threadIdx.x < per_block and chunk < num_chunks:
        _prefetch_chunk(flat, offset, min(int64(L2_CHUNK_BYTES), nbytes - offset) // 16 * 16)


@kernel
def _l2_warm_slots(arena, pair_slot, first_byte, nbytes, per_block):
    # grid: x over a slot's chunks of [first_byte, first_byte + nbytes), y over pairs; a pair that
    # repeats the pair before it (a run on one slot) or is not resident (negative) asks for nothing
    j = cuda.blockIdx.y
    slot = pair_slot[j]
    chunk = cuda.blockIdx.x * per_block + cuda.threadIdx.x
    offset = int64(chunk) * L2_CHUNK_BYTES
    if slot >= 0 and (j == 0 or pair_slot[j - 1] != slot) and cuda.threadIdx.x < per_block and offset < nbytes:
        _prefetch_chunk(arena, int64(slot) * arena.shape[1] + first_byte + offset,
                        min(int64(L2_CHUNK_BYTES), nbytes - offset) // 16 * 16)


def l2_warm_slots_cuda(arena, pair_slot, first_byte: int, nbytes: int, stream=0) -> int:
    """Ask bytes [first_byte, first_byte + nbytes) of each listed arena slot into L2 (the experts a
    step's pairs read, pair_slot as norm_route leaves it on the device: runs on one slot asked once,
    host-store entries skipped); returns the chunks a slot takes."""
    if not is_contiguous(arena) or data_ptr(arena) % 16 or first_byte % 16 or arena.nbytes // max(1, arena.shape[0]) % 16:
        raise ValueError("L2 warming needs a contiguous arena, its slots and the range on 16-byte boundaries")
    if not 0 <= first_byte <= first_byte + nbytes <= arena.nbytes // max(1, arena.shape[0]):
        raise ValueError(f"bytes [{first_byte}, {first_byte + nbytes}) outside an arena slot")
    chunks = -(-int(nbytes) // L2_CHUNK_BYTES)
    if chunks and pair_slot.shape[0]:
        per_block = min(WARM_CHUNKS_PER_BLOCK, WARP)
        flat = arena.view(np.uint8).reshape(arena.shape[0], arena.nbytes // arena.shape[0])
        _l2_warm_slots[(ceil_div(chunks, per_block), pair_slot.shape[0]), WARP, stream](
            flat, pair_slot, int64(first_byte), int64(nbytes), per_block)
    return chunks


def l2_warm_cuda(array, stream=0) -> int:
    """Ask a contiguous device array's bytes into L2 (a whole 16-byte tail short of its end), over
    ceil(chunks / WARM_CHUNKS_PER_BLOCK) blocks of one warp; returns the chunks asked for. Nothing
    reads the result: the array is unchanged, a later kernel finds its lines in L2."""
    if not is_contiguous(array) or data_ptr(array) % 16:
        raise ValueError("L2 warming needs a contiguous array on a 16-byte boundary")
    num_chunks = l2_chunks(array)
    if num_chunks:
        flat = array.reshape(array.size).view(np.uint8)
        per_block = min(WARM_CHUNKS_PER_BLOCK, WARP)
        _l2_warm[ceil_div(num_chunks, per_block), WARP, stream](flat, int64(array.nbytes), num_chunks, per_block)
    return num_chunks
