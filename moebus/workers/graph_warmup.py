"""Decode graphs captured before a worker serves (gpu_worker.warm_decode_graphs): the decode step of
every batch size a worker will likely see, and its twin with a grammar mask, so that no step pays a
capture (~0.2 s at 48 layers on an H200) or kernel compiles (seconds each on a cold kernel cache: the
GEMV kernels are specialised by token count, up to 8) when a batch of a new size first runs. The
graphs share one scratch pool (Stage.graph_pool): the memory of the largest step.

Then (``warm_prompt_steps``) one eager prompt step of each token count up to the GEMVs' pass (linear.MAX_TOKENS)
that no decode graph covers, and one past it: a text stream's first prompt step of 5-9 tokens otherwise
compiled (or loaded) its GEMV variants while every stream waited (H200, sixteenth session: a 6-token step took
3.6 s in a fresh kernel cache, compiling linear_rows, expert_gate_up and expert_down for 6 tokens)."""
from __future__ import annotations

import numpy as np

from moebus.workers.batch import StepBatch
from moebus.workers.stage import ROUTED_MAX_TOKENS, Stage


def warm_graphs(stage: Stage, sizes, masked: bool = True, progress=iter) -> int:
    """Capture the decode step of every batch size in ``sizes`` (and, on the last stage, its twin
    with a grammar mask when ``masked``). The steps write KV at position 0 of slots that no sequence
    holds yet. Returns how many graphs were captured (0 where graphs are off)."""
    if not stage.use_graphs:
        return 0
    before = stage.graph_captures
    for n in progress([n for n in sizes if n <= min(stage.kv.num_slots, ROUTED_MAX_TOKENS)]):
        for with_mask in (False, True) if masked and stage.is_last else (False,):
            batch = warm_decode_batch(stage, n, with_mask)
            hidden = None if stage.is_first else np.zeros((n, stage.cfg.hidden_size), np.float32)
            stage._graph_for(batch, stage._host_inputs(batch, hidden))
    stage.ops.begin_step()
    return stage.graph_captures - before


def warm_prompt_sizes(max_batch: int, gemv_tokens: int) -> list[int]:
    """The prompt steps' token counts to run at start: 1..gemv_tokens (a GEMV pass's tokens: each its own
    kernel variants) but those the decode graphs of warm_sizes(max_batch) already ran, and gemv_tokens + 1
    (a step of more than one pass)."""
    graphs = set(warm_sizes(max_batch))
    return [n for n in range(1, gemv_tokens + 1) if n not in graphs] + [gemv_tokens + 1]


def warm_prompt_steps(stage: Stage, sizes) -> int:
    """One eager prompt step of each of ``sizes`` tokens, a sequence at position 0 of slot 0 (no sequence
    holds it yet), greedy. Returns how many ran (sizes beyond the context or the short steps' tokens: none)."""
    ran = 0
    for n in sizes:
        if n > min(stage.max_context, ROUTED_MAX_TOKENS):
            continue
        last = stage.is_last
        batch = StepBatch(slots=np.zeros(1), starts=np.zeros(1), lengths=np.full(1, n),
                          tokens=np.zeros(n, np.int32) if stage.is_first else None,
                          temperature=np.zeros(1, np.float32) if last else None)
        hidden = None if stage.is_first else np.zeros((n, stage.cfg.hidden_size), np.float32)
        stage.forward(batch, hidden)
        ran += 1
    stage.ops.begin_step()
    return ran


def warm_decode_batch(stage: Stage, n: int, masked: bool) -> StepBatch:
    """A decode step of ``n`` sequences at position 0 (Stage.warm_graphs); ``masked``: the first
    row constrained by an all-allowing grammar mask."""
    last = stage.is_last
    mask = {}
    if masked:
        words = -(-stage.cfg.vocab_size // 32)
        mask = dict(mask=np.full((1, words), 0xFFFFFFFF, np.uint32), mask_rows=np.array([0] + [-1] * (n - 1), np.int32))
    return StepBatch(slots=np.arange(n), starts=np.zeros(n), lengths=np.ones(n),
                     tokens=np.zeros(n, np.int32) if stage.is_first else None,
                     temperature=np.ones(n, np.float32) if last else None, top_k=np.zeros(n, np.int32) if last else None,
                     top_p=np.ones(n, np.float32) if last else None, u=np.full(n, 0.5, np.float32) if last else None,
                     **mask)


def warm_sizes(max_batch: int) -> list[int]:
    """The decode batch sizes a worker captures at start: every size up to 16, then powers of two
    and max_batch itself (other sizes are captured when they first run)."""
    sizes = set(range(1, min(max_batch, 16) + 1)) | {1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch}
    return sorted(sizes | {max_batch})
