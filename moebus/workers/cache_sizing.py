"""How big a worker's expert cache starts: all free VRAM of its GPU after the dense weights and KV
cache are in, minus the start-up reserve and the step scratch, in whole segments — and never more
than the stage's experts need. On cpu the GPU is emulated: its ledger is charged for the dense
weights and KV cache first, as VRAM would be."""
from __future__ import annotations

import logging
from pathlib import Path

from moebus.cuda.ledger import MIB, EmulatedGpu

log = logging.getLogger("moebus.worker")
# On a real GPU, memory the worker needs after start-up besides the step pool: kernel modules loaded
# at first use, the copy stream's events, numba's own small allocations.
CUDA_HEADROOM_BYTES = 256 * MIB


def stage_dense_bytes(ckpt, layers: range, is_first: bool, is_last: bool, kv_bytes: int) -> int:
    """VRAM the stage needs besides experts: its dense weights as stored, plus its KV cache."""
    cfg = ckpt.config
    total = kv_bytes
    for i in layers:
        total += sum(t.nbytes for t in ckpt.attention(i).values())
        total += ckpt.router(i).nbytes if cfg.is_moe_layer(i) else sum(t.nbytes for t in ckpt.dense_mlp(i).values())
    if is_first:
        total += ckpt.embedding().nbytes
    if is_last:
        total += ckpt.final_norm().nbytes + ckpt.lm_head().nbytes
    return total


class ScratchBudget:
    """Activation memory of a step: a standing part sized for ``tokens`` (decode of a full batch)
    and, per token beyond, float32 activations with room for the pool's reuse."""

    def __init__(self, cfg, tokens: int):
        self.tokens = tokens
        self.per_token_bytes = 2 * 4 * (8 * cfg.hidden_size + 4 * cfg.num_heads * cfg.head_dim
                                        + cfg.top_k * (2 * cfg.hidden_size + 2 * cfg.moe_intermediate_size)
                                        + 2 * cfg.num_experts)
        self.fixed_bytes = 4 * cfg.vocab_size * 64  # logits of the sampled rows
        self.standing_bytes = self.bytes_for(tokens)

    def bytes_for(self, tokens: int) -> int:
        return self.fixed_bytes + self.per_token_bytes * tokens

    def tokens_within(self, extra_bytes: int) -> int:
        """Tokens one piece may have with ``extra_bytes`` lent on top of the standing scratch."""
        return self.tokens + extra_bytes // self.per_token_bytes


def reserve_for(settings, gpu: int) -> float:
    values = settings.vram_reserve_mib
    return float(values[gpu]) if gpu < len(values) else 0.0


def emulated_gpu(settings, gpu: int) -> EmulatedGpu:
    root = Path(settings.emulated_vram_dir or ".")
    return EmulatedGpu(root / f"gpu{gpu}", capacity_mib=settings.emulated_vram_mib[gpu])


def startup_capacity_bytes(free_bytes: int, reserve_mib: float, scratch_bytes: int) -> int:
    return max(0, int(free_bytes - reserve_mib * MIB - scratch_bytes))
