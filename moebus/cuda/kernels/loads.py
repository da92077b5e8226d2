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

from moebus.cuda.kernels.compat import SIMULATOR, bits_as_f32, cuda, data_ptr, device, float32, int64, is_contiguous, uint32
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
