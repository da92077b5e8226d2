"""A prompt chunk the worker holds part-done (STEP_REPLY ``pending_rows``, workers/spanning_chunk.py):
the broker keeps the sequence's ``fed``, sends the same feed (and, for its last chunk, the same draw)
until the worker reports it done, and plans look-ahead steps without it."""
import numpy as np
import pytest

from moebus.broker.lookahead import lookahead_plan
from moebus.broker.scheduler import Scheduler
from moebus.broker.sequence import Sequence
from moebus.broker.steps import pending_rows_fit
from moebus.common.protocol import Sampling
from moebus.common.tokenizer import StreamDecoder, TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return TextTokenizer(tiny_model)


def seq(tokenizer, sid: str, prompt, **sampling) -> Sequence:
    return Sequence(id=sid, client=b"c", prompt=list(prompt), sampling=Sampling(**{"max_tokens": 8, **sampling}),
                    decoder=StreamDecoder(tokenizer), stop_ids=frozenset(), max_context=512)


def beside_decode(tokenizer, cap: int | None = None, **sampling) -> Scheduler:
    """``a`` decodes; ``b``'s prompt of 100 tokens waits to be read."""
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=512, max_prefill_tokens_beside_decode=cap)
    s.submit(seq(tokenizer, "a", [5, 6, 7]))
    first = s.plan()
    s.advance(first)
    first.seqs[0].accept(40, 0.0)
    s.submit(seq(tokenizer, "b", range(3, 103), **sampling))
    return s


def test_a_pending_row_keeps_its_fed_and_goes_again_as_it_was(tokenizer):
    s = beside_decode(tokenizer, temperature=0.9, seed=4)
    step = s.plan()
    assert [q.id for q in step.seqs] == ["a", "b"] and step.lengths.tolist() == [1, 100] and step.samples == [True, True]
    b = step.seqs[1]
    s.advance(step, pending_rows={1})
    step.seqs[0].accept(41, 0.0)
    assert b.fed == 0 and b.held_feed == 100 and step.seqs[0].fed == 4
    s.max_prefill_tokens_beside_decode = 16  # a budget that would cut another chunk: the feed stays
    again = s.plan()
    assert again.lengths.tolist() == [1, 100] and again.starts.tolist() == [4, 0]
    assert again.tokens[1:].tolist() == list(range(3, 103))
    assert again.u[1] == step.u[1] == np.float32(np.random.default_rng(4).random())  # the one draw, once
    s.advance(again)
    assert b.fed == 100 and b.held_feed == 0 and b.held_draw is None
    for q, token in zip(again.seqs, (42, 50)):
        q.accept(token, 0.0)
    assert s.plan().lengths.tolist() == [1, 1]


def test_a_chunk_that_is_not_the_last_holds_no_draw(tokenizer):
    s = beside_decode(tokenizer, cap=40)
    step = s.plan()
    assert step.lengths.tolist() == [1, 40] and step.samples == [True, False]
    s.advance(step, pending_rows=[1])
    assert step.seqs[1].held_feed == 40 and step.seqs[1].held_draw is None


def test_the_look_ahead_step_leaves_a_held_chunk_out(tokenizer):
    s = beside_decode(tokenizer, cap=40)
    step = s.plan()
    for chunks_span in (False, True):  # not held, not the last: its row does not sample, no look-ahead
        assert lookahead_plan(s, step, 7, chunks_span) is None  # (as before: no extra decode-only steps)
    s.advance(step, pending_rows=[1])
    step.seqs[0].accept(41, 0.0)
    held = s.plan()
    ahead = lookahead_plan(s, held, 8, chunks_span=True)
    assert [q.id for q in ahead.seqs] == ["a"] and ahead.tokens_rows.tolist() == [0] and ahead.starts.tolist() == [5]


def test_a_last_chunk_beside_decode_sits_the_look_ahead_out_where_chunks_may_span(tokenizer):
    s = beside_decode(tokenizer)
    step = s.plan()
    assert step.samples == [True, True]
    assert [q.id for q in lookahead_plan(s, step, 7).seqs] == ["a", "b"]  # no budget: its token is certain
    assert [q.id for q in lookahead_plan(s, step, 7, chunks_span=True).seqs] == ["a"]


def test_pending_rows_must_be_prompt_rows_of_the_step(tokenizer):
    s = beside_decode(tokenizer)
    step = s.plan()
    assert pending_rows_fit(None, step) and pending_rows_fit(np.array([1]), step)
    assert not pending_rows_fit(np.array([0]), step)  # a decode row's token is never held back
    assert not pending_rows_fit(np.array([2]), step)
