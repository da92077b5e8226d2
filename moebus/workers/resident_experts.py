"""Every expert of a stage resident in one arena: slot = (moe layer index) * E + expert. The simplest
residency, used when the whole stage fits in VRAM; the elastic ExpertCache offers the same calls."""
from __future__ import annotations

import numpy as np

from moebus.cuda.dtypes import STORAGE


class ResidentExperts:
    def __init__(self, ckpt, layers: range, backend):
        cfg = ckpt.config
        self.num_experts = cfg.num_experts
        moe_layers = [i for i in layers if cfg.is_moe_layer(i)]
        self.base_slot = {layer: n * cfg.num_experts for n, layer in enumerate(moe_layers)}
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        slot_elems = 3 * inter * d
        host = np.empty((len(moe_layers) * cfg.num_experts, slot_elems), dtype=STORAGE[ckpt.weight_dtype])
        for layer, base in self.base_slot.items():
            for e in range(cfg.num_experts):
                gate, up, down = ckpt.expert(layer, e)
                host[base + e] = np.concatenate([gate.ravel(), up.ravel(), down.ravel()])
        self.arena = backend.persist(host)

    def acquire(self, layer: int, expert_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Arena slots of ``expert_ids`` of ``layer`` and which are ready now (here: all)."""
        slots = (self.base_slot[layer] + np.asarray(expert_ids)).astype(np.int32)
        return slots, np.ones(len(slots), dtype=bool)

    def wait(self) -> None:
        """Block until every copy started by acquire() has landed (none here)."""

    def release(self) -> None:
        """Unpin what this step acquired."""
