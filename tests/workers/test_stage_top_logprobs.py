"""Top logprobs cost only the rows that asked: the last stage computes them for ``logprob_rows``
only, and those rows get exactly what they get when every row asks (prefill in pieces included)."""
import numpy as np

from moebus.cuda.kernels.top_logprobs import top_logprobs_rows_ref
from moebus.workers.batch import StepBatch, split_tokens
from moebus.workers.prompt_loan import forward_in_pieces
from moebus.workers.local import LocalModel

PROMPTS = [[5, 9, 13], [7, 7, 7, 8], [3, 1, 4, 1, 5]]
BATCH = dict(slots=[0, 1, 2], starts=[0, 0, 0], lengths=[3, 4, 5], tokens=np.concatenate(PROMPTS),
             temperature=[0.0, 0.0, 0.0])


def test_only_the_rows_that_asked_come_back_and_match_every_row_asking(tiny_model):
    model = LocalModel(tiny_model, parts=2, max_context=64)
    every = model.step(StepBatch(**BATCH, top_logprobs=4), want_logits=True)
    assert every.top_ids.shape == (3, 4)
    ids, logprobs = top_logprobs_rows_ref(every.logits, 4)
    assert np.array_equal(every.top_ids, ids) and np.array_equal(every.top_logprobs, logprobs)
    some = model.step(StepBatch(**BATCH, top_logprobs=4, logprob_rows=np.array([0, 2], np.int32)))
    assert some.top_ids.shape == (2, 4) and some.top_logprobs.shape == (2, 4)
    assert np.array_equal(some.top_ids, every.top_ids[[0, 2]])
    assert np.array_equal(some.top_logprobs, every.top_logprobs[[0, 2]])
    assert np.array_equal(some.tokens, every.tokens)


def test_pieces_of_a_long_step_put_each_asking_row_back_in_place(tiny_model):
    model = LocalModel(tiny_model, parts=1, max_context=64)
    rows = np.array([1, 2], np.int32)
    whole = model.step(StepBatch(**BATCH, top_logprobs=3, logprob_rows=rows))
    pieces = split_tokens(StepBatch(**BATCH, top_logprobs=3, logprob_rows=rows), 5)
    # a piece asks only for its rows (positions in the piece) that asked and end in it: they sample there
    assert [list(p.top_rows()) for p, _, _, _ in pieces] == [[], [0], [0]]
    stage = model.stages[0]
    split = forward_in_pieces(stage._forward, StepBatch(**BATCH, top_logprobs=3, logprob_rows=rows), None, False, 5,
                              stage.is_last)
    assert np.array_equal(split.top_ids, whole.top_ids)
    np.testing.assert_allclose(split.top_logprobs, whole.top_logprobs, atol=1e-5)


def test_no_row_asking_returns_empty_rows(tiny_model):
    model = LocalModel(tiny_model, parts=1, max_context=64)
    out = model.step(StepBatch(**BATCH, top_logprobs=2, logprob_rows=np.zeros(0, np.int32)))
    assert out.top_ids.shape == (0, 2) and len(out.tokens) == 3
