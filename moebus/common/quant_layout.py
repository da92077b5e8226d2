"""One quantized expert as one blob of bytes (what the host store pins, a cache slot holds and a miss
moves): the codes of gate (I x D), up (I x D) and down (D x I), then their scales, each section
16-byte aligned.

- fp8: codes 1 byte each; scales float32 on the 128 x 128 block grid of each matrix (quant.py).
- int4: codes two to a byte; per (row, group of 128 inputs) a float32 pair (scale, minimum).

Kernels address the blob as 8-byte words (moe_quant.py): rows are whole words because D and I are
multiples of 16, and a word never straddles a block or a group (128 is a multiple of 16)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from moebus.common.quant import (BLOCK, block_grid, fp8_dequantize, fp8_quantize, int4_dequantize,
                                 int4_quantize)

EXPERT_DTYPES = ("bf16", "fp8", "int4")
QUANTIZED = ("fp8", "int4")
ALIGN = 16
ROW_MULTIPLE = 16  # values per 8-byte word of int4 codes (the kernels' read)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Matrix:
    rows: int
    cols: int
    code_offset: int  # bytes from the blob's start
    scale_offset: int
    scale_shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertLayout:
    dtype: str  # 'fp8' or 'int4'
    hidden: int
    inter: int

    def __post_init__(self):
        if self.dtype not in QUANTIZED:
            raise ValueError(f"experts dtype {self.dtype!r}: a quantized layout is one of {QUANTIZED}")
        if self.hidden % ROW_MULTIPLE or self.inter % ROW_MULTIPLE:
            raise ValueError(f"{self.dtype} experts need hidden and intermediate sizes that are multiples of "
                             f"{ROW_MULTIPLE} (got {self.hidden} and {self.inter}); use experts.dtype bf16")

    def code_bytes(self, rows: int, cols: int) -> int:
        return rows * cols if self.dtype == "fp8" else rows * cols // 2

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        return block_grid(rows, cols) if self.dtype == "fp8" else (rows, -(-cols // BLOCK), 2)

    @cached_property
    def matrices(self) -> tuple[Matrix, Matrix, Matrix]:
        shapes = [(self.inter, self.hidden), (self.inter, self.hidden), (self.hidden, self.inter)]
        code_offsets, offset = [], 0
        for rows, cols in shapes:
            code_offsets.append(offset)
            offset = _align(offset + self.code_bytes(rows, cols))
        out = []
        for (rows, cols), code_offset in zip(shapes, code_offsets):
            shape = self.scale_shape(rows, cols)
            out.append(Matrix(rows, cols, code_offset, offset, shape))
            offset = _align(offset + 4 * int(np.prod(shape)))
        return tuple(out)

    @cached_property
    def blob_bytes(self) -> int:
        last = self.matrices[-1]
        return _align(last.scale_offset + 4 * int(np.prod(last.scale_shape)))

    def kernel_words(self) -> tuple[int, ...]:
        """Word offsets the kernels take: gate, up, down codes, then gate, up, down scales."""
        m = self.matrices
        return tuple(x.code_offset // 4 for x in m) + tuple(x.scale_offset // 4 for x in m)

    # -- host side ----------------------------------------------------------------------------------

    def parts(self, blob: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(codes, scales) views of each matrix of a blob (uint8, blob_bytes)."""
        out = []
        for m in self.matrices:
            codes = blob[m.code_offset : m.code_offset + self.code_bytes(m.rows, m.cols)]
            n = int(np.prod(m.scale_shape))
            scales = blob[m.scale_offset : m.scale_offset + 4 * n].view(np.float32).reshape(m.scale_shape)
            out.append((codes.reshape(m.rows, -1), scales))
        return out

    def pack(self, parts, out: np.ndarray | None = None) -> np.ndarray:
        """A blob from (codes, scales) of gate, up, down in this layout's format."""
        blob = np.zeros(self.blob_bytes, np.uint8) if out is None else out
        blob[:] = 0
        for (codes, scales), (codes_view, scales_view) in zip(parts, self.parts(blob)):
            codes_view[...] = codes
            scales_view[...] = scales
        return blob

    def quantize(self, gate, up, down, out: np.ndarray | None = None) -> np.ndarray:
        """A blob from float matrices (round to nearest in this layout's format)."""
        quantize = fp8_quantize if self.dtype == "fp8" else int4_quantize
        return self.pack([quantize(w) for w in (gate, up, down)], out)

    def dequantize(self, blob: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) float32, as the kernels see them."""
        out = []
        for m, (codes, scales) in zip(self.matrices, self.parts(np.asarray(blob, np.uint8))):
            if self.dtype == "fp8":
                out.append(fp8_dequantize(codes, scales))
            else:
                out.append(int4_dequantize(codes, scales, m.cols))
        return tuple(out)


def expert_layout(dtype: str, hidden: int, inter: int) -> ExpertLayout | None:
    """The layout of quantized experts, None for bf16 (the stored dtype, as before)."""
    if dtype not in EXPERT_DTYPES:
        raise ValueError(f"experts dtype {dtype!r}: choose one of {', '.join(EXPERT_DTYPES)}")
    return None if dtype == "bf16" else ExpertLayout(dtype, hidden, inter)
