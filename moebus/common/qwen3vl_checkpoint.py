"""Where a Qwen3-VL-MoE checkpoint keeps its language model, and its fused experts in either
orientation. The Hub's checkpoints (and what transformers' ``save_pretrained`` writes) put the
language model under ``model.language_model.`` and the unembedding at ``lm_head.``; the experts are
per-expert tensors or fused ones: ``experts.gate_up_proj`` (E, D, 2I) and ``experts.down_proj``
(E, I, D) on the Hub, (E, 2I, D) and (E, D, I) as transformers keeps them in memory and saves them.
Told apart by shape; a shape that fits both (D = 2I, or I = D) is taken as transformers' own, which
is what its loader does (``Transpose(check_dims=True)`` keeps a tensor that already fits)."""
from __future__ import annotations

import numpy as np

from moebus.common.errors import CheckpointError

PREFIXES = {"model.": ("model.language_model.", "language_model.model.", "model."),
            "lm_head.": ("lm_head.", "language_model.lm_head.")}


def resolve(name: str, stored: dict) -> str:
    """The stored name of a causal-LM tensor name (``model.layers.0...``, ``lm_head.weight``)."""
    for short, longs in PREFIXES.items():
        if name.startswith(short):
            for long in longs:
                if long + name[len(short):] in stored:
                    return long + name[len(short):]
    return name


def _oriented(array: np.ndarray, expected: tuple[int, ...], full: str) -> tuple[np.ndarray, bool]:
    """(array, is_transposed) for a fused (E, a, b) tensor expected as ``expected``."""
    if tuple(array.shape) == expected:
        return array, False
    if tuple(array.shape) == (expected[0], expected[2], expected[1]):
        return array, True
    raise CheckpointError(f"tensor {full} has shape {tuple(array.shape)}, config implies {expected} "
                          f"(or {(expected[0], expected[2], expected[1])} as the Hub stores it)")


def fused_expert(ckpt, prefix: str, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate (I, D), up (I, D), down (D, I)) of one expert from the fused tensors under ``prefix``."""
    c, arch = ckpt.config, ckpt.arch
    i, d, e = c.moe_intermediate_size, c.hidden_size, c.num_experts
    gate_up, flipped = _oriented(ckpt.tensor(prefix + arch.fused_gate_up), (e, 2 * i, d), prefix + arch.fused_gate_up)
    down, down_flipped = _oriented(ckpt.tensor(prefix + arch.fused_down), (e, d, i), prefix + arch.fused_down)
    if flipped:
        gate, up = (np.ascontiguousarray(gate_up[expert, :, s].T) for s in (slice(0, i), slice(i, 2 * i)))
    else:
        gate, up = gate_up[expert, :i], gate_up[expert, i:]
    return gate, up, (np.ascontiguousarray(down[expert].T) if down_flipped else down[expert])
