"""KV cache of one stage: per layer, k and v of shape (num_slots, KVH, max_context, hd) float32.
A sequence owns one slot for its life (the broker assigns it); a new sequence in a slot simply
overwrites from position 0, since attention never reads past a token's own position."""
from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, backend, num_layers: int, num_slots: int, num_kv_heads: int, max_context: int,
                 head_dim: int):
        self.num_slots = num_slots
        self.max_context = max_context
        shape = (num_slots, num_kv_heads, max_context, head_dim)
        self.k = [backend.zeros(shape, np.float32) for _ in range(num_layers)]
        self.v = [backend.zeros(shape, np.float32) for _ in range(num_layers)]

    @staticmethod
    def bytes_needed(num_layers, num_slots, num_kv_heads, max_context, head_dim) -> int:
        return 2 * num_layers * num_slots * num_kv_heads * max_context * head_dim * 4
