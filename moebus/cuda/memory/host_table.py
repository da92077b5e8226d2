"""Pinned host memory mapped into the device (the expert host store's, the token embedding's), and
where the token embedding lives. A step reads only its tokens' rows of it (4 KiB a token at A3B's
2,048 bf16 columns), so on cuda the table stays in pinned host memory mapped into the device and the
gather kernel reads those rows over PCIe (kernels/embedding.py); the VRAM it would take goes to the
expert cache (A3B's 151,936 rows: 593.5 MiB, ~65 bf16 experts of 9 MiB), as llama.cpp keeps its
token embedding on the CPU. The emulated GPU of the cpu device is charged likewise
(cache_sizing.stage_dense_bytes). ``MOEBUS_EMBEDDING_VRAM=1``: the table in VRAM, as before the
twenty-seventh session (for a comparison on the GPU)."""
from __future__ import annotations

import os

import numpy as np

from moebus.common.errors import ConfigError


def embedding_in_vram(environ=os.environ) -> bool:
    value = environ.get("MOEBUS_EMBEDDING_VRAM", "0")
    if value not in ("0", "1"):
        raise ConfigError(f"MOEBUS_EMBEDDING_VRAM={value!r}: 1 keeps the token embedding in VRAM, 0 (the default) "
                         f"in mapped host memory")
    return value == "1"


def mapped_empty(shape, dtype):
    """Pinned host memory mapped into the device's address space (the expert host store, the token
    embedding): copies from it run at full speed, and kernels can read it in place."""
    from moebus.cuda.kernels.compat import SIMULATOR, cuda

    return cuda.pinned_array(shape, dtype=dtype) if SIMULATOR else cuda.mapped_array(shape, dtype=dtype)


def device_view(host):
    """A device array over mapped host memory (mapped_empty), for kernels to read in place; it keeps
    the host memory alive."""
    from moebus.cuda.kernels.compat import SIMULATOR, cuda

    return host if SIMULATOR else cuda.as_cuda_array(host)  # simulated kernels take host arrays as they are


def mapped_table(array: np.ndarray):
    """A copy of ``array`` in mapped host memory, as the device view kernels read."""
    host = mapped_empty(array.shape, array.dtype)
    host[...] = array
    return device_view(host)
