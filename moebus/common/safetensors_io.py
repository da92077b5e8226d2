"""safetensors files read as memory maps (a 60 GB model is never read into RAM twice) and written
from numpy. bf16 tensors are numpy uint16 arrays holding the bf16 bit patterns (see cuda/dtypes.py)."""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

from moebus.common.errors import CheckpointError

# safetensors dtype name -> numpy storage dtype; BF16 is stored as its raw 16 bits.
STORAGE_DTYPES = {
    "BF16": np.dtype(np.uint16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "F8_E4M3": np.dtype(np.uint8),  # FP8 checkpoints: raw e4m3fn codes (common/quant.py)
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped read-only. ``array(name)`` is a zero-copy view."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._map) < 8:
            raise CheckpointError(f"{self.path}: too short to be a safetensors file")
        (header_bytes,) = struct.unpack("<Q", self._map[:8])
        if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > len(self._map):
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({header_bytes} bytes)")
        try:
            header = json.loads(self._map[8 : 8 + header_bytes])
        except ValueError as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header: {e}") from e
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries = header
        self._data_start = 8 + header_bytes

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype_name(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def array(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        dtype = STORAGE_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or self._data_start + end > len(self._map):
            raise CheckpointError(f"{self.path}: tensor {name} has inconsistent offsets")
        flat = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + begin)
        return flat.reshape(shape)


def save_file(tensors: dict[str, tuple[np.ndarray, str]], path: str | Path, metadata: dict | None = None):
    """Write ``{name: (array, dtype_name)}`` (dtype_name as in STORAGE_DTYPES) as safetensors."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    ordered = sorted(tensors.items())
    for name, (array, dtype_name) in ordered:
        if array.dtype != STORAGE_DTYPES[dtype_name]:
            raise ValueError(f"{name}: {array.dtype} cannot be stored as {dtype_name}")
        header[name] = {"dtype": dtype_name, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, (array, _) in ordered:
            f.write(memoryview(np.ascontiguousarray(array)).cast("B"))
