"""How big a worker's expert cache starts: all free VRAM of its GPU after the dense weights and KV
cache are in, minus the start-up reserve and the step scratch, in whole segments — and never more
than the stage's experts need. On cpu the GPU is emulated: its ledger is charged for the dense
weights and KV cache first, as VRAM would be.

The step scratch is measured, not estimated (as nano-vllm measures a warm-up before it sizes its KV
cache): the stage runs a decode step of a full batch and the largest step the broker sends
(``max_batch`` sequences, ``max_step_tokens`` of prefill), every row asking for top logprobs and
each sequence at the end of its context so attention reads the most. The decode step's peak is the
standing scratch, kept out of the cache; the slope between the two is what each token beyond costs,
which a longer step borrows from the cache (the prompt-path loan, workers/prompt_loan.py). On cuda the step
pool counts its device bytes; on cpu tracemalloc counts numpy's allocations, and that figure is
what the emulated GPU's ledger is charged."""
from __future__ import annotations

import logging
import math
import tracemalloc
from pathlib import Path

import numpy as np

from moebus.common.fp8_dense import PROJECTIONS, fp8_rows_nbytes
from moebus.cuda.memory.host_table import embedding_in_vram
from moebus.cuda.memory.ledger import MIB, EmulatedGpu
from moebus.cuda.memory.step_pool import ceil_pow2
from moebus.workers.batch import StepBatch

log = logging.getLogger("moebus.worker")
# On a real GPU, memory the worker needs after start-up besides the step pool: kernel modules loaded
# at first use, the copy stream's events, numba's own small allocations.
CUDA_HEADROOM_BYTES = 256 * MIB


def stage_dense_bytes(ckpt, layers: range, is_first: bool, is_last: bool, kv_bytes: int,
                      lm_head_dtype: str = "bf16", attention_dtype: str = "bf16") -> int:
    """VRAM the stage needs besides experts: its dense weights as stored (the lm_head as
    ``lm_head_dtype`` holds it and the q/k/v/o projections as ``attention_dtype`` does: fp8 codes and
    scales are ~half of bf16, left to the experts), plus its KV cache. The token embedding is in host
    memory unless MOEBUS_EMBEDDING_VRAM=1 (memory/host_table.py)."""
    cfg = ckpt.config
    total = kv_bytes
    for i in layers:
        total += attention_bytes(ckpt.attention(i), attention_dtype)
        total += ckpt.router(i).nbytes if cfg.is_moe_layer(i) else sum(t.nbytes for t in ckpt.dense_mlp(i).values())
    if is_first and embedding_in_vram():
        total += ckpt.embedding().nbytes
    if is_last:
        total += ckpt.final_norm().nbytes + lm_head_bytes(ckpt, lm_head_dtype)
    return total


def attention_bytes(tensors: dict, attention_dtype: str) -> int:
    """A layer's attention weights (checkpoint.attention's) on the device: as stored, or with q/k/v/o as
    fp8_dense.attention_fp8 holds them (codes and a float32 scale per row and 128 inputs)."""
    return sum(fp8_rows_nbytes(*t.shape) if attention_dtype == "fp8" and name in PROJECTIONS else t.nbytes
               for name, t in tensors.items())


def lm_head_bytes(ckpt, lm_head_dtype: str) -> int:
    """The lm_head's bytes on the device: as stored, or as fp8_dense.lm_head_fp8 makes it."""
    if lm_head_dtype == "fp8":
        return fp8_rows_nbytes(ckpt.config.vocab_size, ckpt.config.hidden_size)
    return ckpt.lm_head().nbytes


def floor_pow2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


class ScratchBudget:
    """Activation memory of a step: a standing part that covers steps of up to ``tokens`` tokens
    and, per token beyond, ``per_token_bytes``. ``ScratchBudget(cfg, tokens)`` is an estimate from
    the shapes (tests); workers use ``measured()``.

    ``pow2_classes`` (cuda): the step pool hands out buffers in power-of-two size classes, so a step
    of T tokens takes what a step of the next power of two does (on the H200 a 756-token image step
    allocated 448 MiB beyond a loan sized linearly from the 512-token warm-up: twenty-sixth session);
    the tokens beyond ``tokens`` are then counted up to that power of two."""

    def __init__(self, cfg, tokens: int):
        per_token_bytes = 2 * 4 * (8 * cfg.hidden_size + 4 * cfg.num_heads * cfg.head_dim
                                   + cfg.top_k * (2 * cfg.hidden_size + 2 * cfg.moe_intermediate_size)
                                   + 2 * cfg.num_experts)
        fixed_bytes = 4 * cfg.vocab_size * 64  # logits of the sampled rows
        self._set(tokens, fixed_bytes + per_token_bytes * tokens, per_token_bytes)

    @classmethod
    def measured(cls, tokens: int, standing_bytes: int, per_token_bytes: int,
                 pow2_classes: bool = False) -> "ScratchBudget":
        budget = cls.__new__(cls)
        budget._set(tokens, standing_bytes, per_token_bytes, pow2_classes)
        return budget

    def _set(self, tokens: int, standing_bytes: int, per_token_bytes: int, pow2_classes: bool = False) -> None:
        self.tokens, self.standing_bytes, self.per_token_bytes = int(tokens), int(standing_bytes), int(per_token_bytes)
        self.pow2_classes = bool(pow2_classes)

    def bytes_for(self, tokens: int) -> int:
        if tokens <= self.tokens:
            return self.standing_bytes
        counted = ceil_pow2(tokens) if self.pow2_classes else tokens
        return self.standing_bytes + self.per_token_bytes * (counted - self.tokens)

    def tokens_within(self, extra_bytes: int) -> int:
        """Tokens one piece may have with ``extra_bytes`` lent on top of the standing scratch."""
        linear = self.tokens + extra_bytes // self.per_token_bytes
        return max(self.tokens, floor_pow2(linear)) if self.pow2_classes else linear


def widened(scratch: ScratchBudget, spare_bytes: int, max_step_tokens: int) -> ScratchBudget:
    """``scratch`` with its standing part grown into VRAM that nothing else uses (a GPU whose cache
    holds every expert with room to spare), up to ``max_step_tokens``: steps that long then take
    their buffers from that room instead of a prompt-path loan, which would evict experts that the
    next decode steps then miss."""
    tokens = min(max_step_tokens, scratch.tokens_within(max(0, spare_bytes)))
    if tokens <= scratch.tokens:
        return scratch
    return ScratchBudget.measured(tokens, scratch.bytes_for(tokens), scratch.per_token_bytes, scratch.pow2_classes)


def budget_bytes(settings, gpu: int, total_bytes: int) -> int | None:
    """The VRAM budget of GPU ``gpu`` (worker order): ``gpu_memory_mib`` for it and/or
    ``gpu_memory_utilization`` of its total, the smaller; None when neither is set."""
    limits = []
    if gpu < len(settings.gpu_memory_mib):
        limits.append(int(settings.gpu_memory_mib[gpu] * MIB))
    if settings.gpu_memory_utilization is not None:
        limits.append(int(settings.gpu_memory_utilization * total_bytes))
    return min(limits) if limits else None


class DeviceBudget:
    """A GPU seen as if it had only ``budget_bytes`` for moebus: what moebus' processes allocate on it
    after ``baseline`` (this worker's context, before its weights) counts against the budget, and
    free is the smaller of the driver's free and what is left of the budget. So the expert cache, its
    reserves and the vision worker's room behave as on a GPU of that size, while other programs
    keep the rest. ``memory_info``: the driver's (free, total) (cuMemGetInfo), or an emulated GPU's."""

    def __init__(self, budget_bytes: int, memory_info):
        self._driver_info = memory_info
        self.baseline_free, total = memory_info()
        self.budget_bytes = min(int(budget_bytes), total)

    def used_bytes(self) -> int:
        return max(0, self.baseline_free - self._driver_info()[0])

    def memory_info(self) -> tuple[int, int]:
        """(free, total) within the budget, as an arena's memory_info."""
        free, _ = self._driver_info()
        return max(0, min(free, self.budget_bytes - self.used_bytes())), self.budget_bytes


def reserve_for(settings, gpu: int) -> float:
    values = settings.vram_reserve_mib
    return float(values[gpu]) if gpu < len(values) else 0.0


def emulated_gpu(settings, gpu: int) -> EmulatedGpu:
    root = Path(settings.emulated_vram_dir or ".")
    return EmulatedGpu(root / f"gpu{gpu}", capacity_mib=settings.emulated_vram_mib[gpu])


def max_free_bytes(cache) -> int:
    """The most bytes that can be free on the cache's GPU when it hands back all it may: free now plus
    every mapped segment above the slots it keeps for one expert group (``min_slots``). What the
    broker compares with the vision worker's charge to place it (broker/vision_placement.py)."""
    free, _ = cache.arena.memory_info()
    return free + cache.arena.tail_to_release(None, cache.min_slots)[1]


def startup_capacity_bytes(free_bytes: int, reserve_mib: float, scratch_bytes: int) -> int:
    return max(0, int(free_bytes - reserve_mib * MIB - scratch_bytes))


def warmup_batch(stage, num_seqs: int, num_tokens: int) -> StepBatch:
    """A step of ``num_seqs`` sequences and ``num_tokens`` tokens, each sequence ending at the end
    of its context (attention's widest read), every row sampling and asking for top logprobs."""
    num_seqs = min(num_seqs, stage.kv.num_slots, num_tokens)
    num_tokens = min(num_tokens, num_seqs * stage.max_context)
    lengths = np.full(num_seqs, num_tokens // num_seqs, np.int32)
    lengths[: num_tokens % num_seqs] += 1
    last = stage.is_last
    return StepBatch(slots=np.arange(num_seqs), starts=stage.max_context - lengths, lengths=lengths,
                     tokens=spread_ids(num_tokens, stage.cfg.vocab_size) if stage.is_first else None,
                     temperature=np.ones(num_seqs, np.float32) if last else None,
                     u=np.full(num_seqs, 0.5, np.float32) if last else None,
                     top_logprobs=WARMUP_TOP_LOGPROBS if last else 0)


def spread_ids(num_tokens: int, vocab_size: int) -> np.ndarray:
    """Token ids that differ from one another (a stride that is prime): the warm-up's tokens route to many
    experts, as a real prompt's do. One id repeated routes every token alike, to top_k experts: a grouped
    expert product then has the fewest tiles, and the measured scratch undercounts a real prompt's."""
    return (np.arange(num_tokens, dtype=np.int64) * 7919 % vocab_size).astype(np.int32)


WARMUP_TOP_LOGPROBS = 20  # the most a request may ask for (protocol.Step.top_logprobs)


def measure_step_bytes(stage, batch: StepBatch) -> int:
    """Peak bytes of scratch one eager step allocates (graphs off: they keep pools of their own)."""
    hidden = None if stage.is_first else np.zeros((batch.num_tokens, stage.cfg.hidden_size), np.float32)
    use_graphs, stage.use_graphs = stage.use_graphs, False
    try:
        if stage.ops.name == "cuda":
            pool = stage.ops.device_pool
            stage.ops.begin_step()
            before = pool.allocated_bytes
            pool.reset_peak()
            stage.forward(batch, hidden)
            stage.ops.synchronize()
            return pool.peak_bytes - before
        tracing = tracemalloc.is_tracing()
        if not tracing:
            tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            stage.forward(batch, hidden)
            return tracemalloc.get_traced_memory()[1] - before
        finally:
            if not tracing:
                tracemalloc.stop()
    finally:
        stage.use_graphs = use_graphs


def measure_scratch(stage, max_batch: int, max_step_tokens: int) -> ScratchBudget:
    """The standing scratch (a full decode step) and the cost per token beyond it (the slope up to
    the largest step the worker is sent), both measured (see the module doc)."""
    stage.scratch = None  # the warm-up itself runs unconstrained
    decode = warmup_batch(stage, max_batch, max_batch)
    largest = warmup_batch(stage, max_batch, max(max_step_tokens, max_batch))
    if stage.ops.name != "cuda":  # one step first, its figure thrown away: tracemalloc would count what
        # a process does once, e.g. numpy importing numpy.ma at its first np.unique, which where no
        # bytecode cache can be read (a fresh or read-only install) compiles it: ~9 MiB at the peak
        measure_step_bytes(stage, decode)
    decode_bytes = measure_step_bytes(stage, decode)
    largest_bytes = max(decode_bytes, measure_step_bytes(stage, largest))
    classes = stage.ops.name == "cuda"  # the step pool's power-of-two buffers (ScratchBudget)
    counted = ceil_pow2(largest.num_tokens) if classes else largest.num_tokens
    if largest.num_tokens > decode.num_tokens:
        per_token_bytes = math.ceil((largest_bytes - decode_bytes) / (counted - decode.num_tokens))
    else:  # no longer step to compare with: the shape estimate
        per_token_bytes = ScratchBudget(stage.cfg, decode.num_tokens).per_token_bytes
    if stage.ops.name == "cuda":
        stage.ops.begin_step()
        stage.ops.release_scratch()  # the warm-up's buffers go back (now: the free VRAM read next counts them)
    log.info("step scratch measured: %.2f MiB for %d sequences decoding, %.1f MiB at %d tokens (%.1f KiB a token)",
             decode_bytes / MIB, decode.num_seqs, largest_bytes / MIB, largest.num_tokens, per_token_bytes / 1024)
    return ScratchBudget.measured(decode.num_tokens, decode_bytes, max(1, per_token_bytes), pow2_classes=classes)
