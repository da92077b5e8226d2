"""The experts of a long step (prefill) on tensor cores: one host round trip per layer reads the
router's choices, the pairs are grouped by expert (cuda/kernels/grouped_moe.py), and each group of
experts that fits the cache is acquired, computed from its arena slots, then released to the next;
a prefill chunk's missed experts are copied in once and serve all of the chunk's tokens. Resident
experts' gate|up products run while the misses are still being copied in.

Used where the backend has tensor cores and the experts are bf16; otherwise Stage._moe (GEMVs)."""
from __future__ import annotations

import numpy as np

from moebus.cuda.kernels.grouped_moe import GroupedExperts, plan_pairs


def can_group_on_device(ops, experts, num_tokens: int) -> bool:
    tensor_cores = getattr(ops, "tensor_cores", None)
    return tensor_cores is not None and num_tokens >= tensor_cores.min_rows and experts.array.dtype == np.uint16


def grouped_moe(ops, experts, layer: int, h, ids_host: np.ndarray, hidden: int, inter: int):
    """(P, D) float32 expert outputs in pair order for ``h`` (T, D) and the router's ids (T, A)."""
    plan = plan_pairs(ids_host, ops.tensor_cores.parts)
    work = GroupedExperts(ops, ops.tensor_cores, h, plan, hidden, inter)
    group = max(1, experts.num_slots)  # a cache smaller than the layer's active experts: in groups
    try:
        for first in range(0, len(plan.experts), group):
            picked = np.arange(first, min(first + group, len(plan.experts)))
            slots, ready = experts.acquire(layer, plan.experts[picked])
            work.gate_up(experts.array, slots[ready], picked[ready])
            if not ready.all():
                experts.wait()
                work.gate_up(experts.array, slots[~ready], picked[~ready])
            work.down(experts.array, slots, picked)
    finally:
        experts.release()
    return work.pair_outputs()
