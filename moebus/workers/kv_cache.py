"""KV cache of one stage: per layer, k and v of shape (num_slots, KVH, max_context, hd), bf16 (uint16
bits, rounded to nearest even when stored) or float32, as the ``kv_dtype`` setting says: bf16 halves
the bytes that decode attention reads at long contexts, float32 keeps the fidelity tests' logits
within 1e-3 of transformers'. A sequence owns one slot for its life (the broker assigns it); a new
sequence in a slot simply overwrites from position 0, since attention never reads past a token's
own position."""
from __future__ import annotations

from moebus.cuda.kernels.attention import KV_STORAGE

KV_DTYPES = tuple(KV_STORAGE)  # "bf16", "fp32"


def resolve_kv_dtype(setting: str, device: str) -> str:
    """The ``kv_dtype`` setting on a device: auto is bf16 on cuda (half the bytes at long contexts)
    and fp32 on cpu (the reference device, whose numpy attention would convert the cache per step)."""
    if setting == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return setting


class KVCache:
    def __init__(self, backend, num_layers: int, num_slots: int, num_kv_heads: int, max_context: int,
                 head_dim: int, kv_dtype: str = "fp32"):
        if kv_dtype not in KV_STORAGE:
            raise ValueError(f"kv_dtype {kv_dtype!r}: one of {', '.join(KV_DTYPES)}")
        self.num_slots = num_slots
        self.max_context = max_context
        self.kv_dtype = kv_dtype
        shape = (num_slots, num_kv_heads, max_context, head_dim)
        self.k = [backend.zeros(shape, KV_STORAGE[kv_dtype]) for _ in range(num_layers)]
        self.v = [backend.zeros(shape, KV_STORAGE[kv_dtype]) for _ in range(num_layers)]

    @staticmethod
    def bytes_needed(num_layers, num_slots, num_kv_heads, max_context, head_dim, kv_dtype: str = "fp32") -> int:
        per_element = KV_STORAGE[kv_dtype].itemsize
        return 2 * num_layers * num_slots * num_kv_heads * max_context * head_dim * per_element
