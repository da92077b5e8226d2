"""The step scratch is measured by warm-up steps, not estimated: on cpu tracemalloc's peak of a full
decode step (the standing part) and the slope up to the largest step; a real step allocates no more
than the budget says for its length."""
import tracemalloc

import numpy as np

from moebus.workers.cache_sizing import measure_scratch, measure_step_bytes, warmup_batch
from moebus.workers.local import LocalModel


def test_warmup_batch_is_the_largest_step_at_the_end_of_the_context(tiny_model):
    stage = LocalModel(tiny_model, parts=1, num_slots=4, max_context=64).stages[0]
    batch = warmup_batch(stage, 4, 30)
    assert batch.num_seqs == 4 and batch.num_tokens == 30 and batch.top_logprobs == 20
    assert (batch.starts + batch.lengths).tolist() == [64] * 4
    assert warmup_batch(stage, 4, 1000).num_tokens == 4 * 64  # never past max_context


# On cpu tracemalloc also counts the Python objects a step makes, which differ by some bytes between
# two steps of one shape (seen: a decode at position 12 measured 20 bytes over the warm-up's); the
# numpy buffers, which the ledger stands for, are the same. On cuda the pool's peak is exact.
TRACEMALLOC_NOISE_BYTES = 1024


def test_measured_standing_scratch_covers_a_real_step_and_grows_with_the_step(tiny_model):
    stage = LocalModel(tiny_model, parts=1, num_slots=4, max_context=64).stages[0]
    budget = measure_scratch(stage, 4, 48)
    assert budget.tokens == 4 and budget.standing_bytes > 0 and budget.per_token_bytes > 0
    assert budget.bytes_for(60) == budget.standing_bytes + 56 * budget.per_token_bytes
    assert budget.bytes_for(3) == budget.standing_bytes
    prompts = [list(range(3, 15)), list(range(20, 32)), list(range(5, 17)), list(range(40, 52))]
    from moebus.workers.batch import StepBatch

    real = StepBatch(slots=[0, 1, 2, 3], starts=[0] * 4, lengths=[12] * 4, tokens=sum(prompts, []),
                     temperature=[0.0] * 4, top_logprobs=5, logprob_rows=np.array([1], np.int32))
    assert measure_step_bytes(stage, real) <= budget.bytes_for(real.num_tokens) + TRACEMALLOC_NOISE_BYTES
    decode = StepBatch(slots=[0, 1, 2, 3], starts=[12] * 4, lengths=[1] * 4, tokens=[1, 2, 3, 4], temperature=[0.0] * 4)
    assert measure_step_bytes(stage, decode) <= budget.standing_bytes + TRACEMALLOC_NOISE_BYTES
    assert not tracemalloc.is_tracing()  # the measurement leaves no tracing behind


def test_a_middle_stage_is_measured_from_hidden_states(tiny_model):
    stages = LocalModel(tiny_model, parts=2, num_slots=2, max_context=32).stages
    assert measure_scratch(stages[0], 2, 16).standing_bytes > 0  # first: token ids in, hidden out
    assert measure_scratch(stages[1], 2, 16).standing_bytes > 0  # last: hidden in, sampling


def test_what_a_process_does_once_at_its_first_step_is_no_scratch(tiny_model):
    """A first step's one-time allocations (numpy imports numpy.ma at its first np.unique, and compiles
    it where no bytecode cache can be read: 10.5 MiB measured instead of 1.3 on a fresh install) are
    left out: a step run first, unmeasured."""
    stage = LocalModel(tiny_model, parts=1, num_slots=4, max_context=64).stages[0]
    plain = measure_scratch(stage, 4, 16)
    forward, once = stage.forward, []

    def first_step_compiles(*args, **kwargs):
        if not once:
            once.append(int(np.ones(8 << 20, np.uint8).sum()))  # 8 MiB held for a moment, as a compile
        return forward(*args, **kwargs)

    stage.forward = first_step_compiles
    again = measure_scratch(stage, 4, 16)
    assert once and plain.standing_bytes < 1 << 20
    assert abs(again.standing_bytes - plain.standing_bytes) <= TRACEMALLOC_NOISE_BYTES
    assert abs(again.per_token_bytes - plain.per_token_bytes) * 12 <= TRACEMALLOC_NOISE_BYTES
