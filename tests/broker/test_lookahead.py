"""Look-ahead plans (broker/lookahead.py): the step after the one in flight, over the same rows, one
position on, its tokens taken from that step; none where the next step is not certain. And their
bookkeeping in flight: an aborted step takes its look-ahead step with it, a finished one does not."""
import numpy as np
import pytest

from moebus.broker.inflight import Inflight
from moebus.broker.lookahead import lookahead_plan
from moebus.broker.scheduler import Scheduler
from moebus.broker.sequence import Sequence
from moebus.common.protocol import Sampling
from moebus.common.tokenizer import StreamDecoder, TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return TextTokenizer(tiny_model)


def decoding(tokenizer, *specs):
    """A scheduler whose sequences (id, sampling) have prefilled and sampled one token."""
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=64)
    for sid, sampling in specs:
        s.submit(Sequence(id=sid, client=b"c", prompt=[5, 6, 7], sampling=Sampling(**{"max_tokens": 6, **sampling}),
                          decoder=StreamDecoder(tokenizer), stop_ids=frozenset({2}), max_context=64))
    prefill = s.plan()
    s.advance(prefill)
    for seq in prefill.seqs:
        seq.accept(40, 0.0)
    return s


def test_the_next_step_feeds_on_the_one_in_flight(tokenizer):
    s = decoding(tokenizer, ("a", {"temperature": 0}), ("b", {"temperature": 0.8, "seed": 3, "logprobs": 2}))
    step = s.plan()
    ahead = lookahead_plan(s, step, 17)
    assert ahead.tokens_from == 17 and [q.id for q in ahead.seqs] == ["a", "b"]
    assert ahead.starts.tolist() == [4, 4] and ahead.lengths.tolist() == [1, 1]
    assert ahead.slots.tolist() == step.slots.tolist() and ahead.samples == [True, True]
    assert ahead.top_logprobs == 2 and ahead.logprob_rows.tolist() == [1]
    # b's draws come in its own order: the third draw of seed 3 (prefill, step, look-ahead)
    assert ahead.u[1] == np.float32(np.random.default_rng(3).random(3)[2])
    assert lookahead_plan(s, ahead, 18).starts.tolist() == [5, 5]  # and on from a look-ahead step


def test_no_look_ahead_where_a_row_ends_by_length(tokenizer):
    s = decoding(tokenizer, ("a", {}), ("b", {"max_tokens": 2}))
    assert lookahead_plan(s, s.plan(), 1) is None  # b ends with the token in flight


@pytest.mark.parametrize("sampling", [{"frequency_penalty": 0.5}, {"logit_bias": [(7, 1.0)]}, "grammar"])
def test_a_row_whose_next_step_needs_its_token_on_the_host_sits_the_look_ahead_out(tokenizer, sampling):
    s = decoding(tokenizer, ("a", {"temperature": 0}), ("b", {} if sampling == "grammar" else sampling),
                 ("c", {"temperature": 0.7}))
    step = s.plan()
    if sampling == "grammar":
        s.running["b"].grammar = object()  # its next mask needs the token in flight (broker/grammar_state.py)
    ahead = lookahead_plan(s, step, 5)
    assert [q.id for q in ahead.seqs] == ["a", "c"] and ahead.tokens_from == 5 and ahead.tokens_rows.tolist() == [0, 2]
    assert ahead.slots.tolist() == step.slots[[0, 2]].tolist() and ahead.starts.tolist() == [4, 4]
    assert ahead.temperature.tolist() == [0.0, np.float32(0.7)]
    assert lookahead_plan(s, ahead, 6) is None  # b is not in it: the next step is an ordinary one, b joins it
    only = decoding(tokenizer, ("b", {} if sampling == "grammar" else sampling))
    step = only.plan()
    if sampling == "grammar":
        only.running["b"].grammar = object()
    assert lookahead_plan(only, step, 1) is None  # nothing left to look ahead with


def test_no_look_ahead_while_a_request_waits_for_a_slot_or_a_row_sits_out(tokenizer):
    s = decoding(tokenizer, ("a", {}))
    step = s.plan()
    s.submit(Sequence(id="late", client=b"c", prompt=[1], sampling=Sampling(), decoder=StreamDecoder(tokenizer),
                      stop_ids=frozenset(), max_context=64))
    assert lookahead_plan(s, step, 1) is None  # it joins at the next ordinary step
    s = decoding(tokenizer, ("a", {}), ("b", {}))
    step = s.plan()
    s.remove(step.seqs[1])  # b was cancelled
    assert lookahead_plan(s, step, 1) is None


def test_an_aborted_step_takes_its_look_ahead_step_and_a_finished_one_does_not(tokenizer):
    s = decoding(tokenizer, ("a", {}))
    table = Inflight(num_stages=1, pipeline=True)
    first = table.start(1, s.plan(), now=0.0)
    ahead = table.start(2, lookahead_plan(s, first.plan, 1), now=0.5)
    assert table.all_at_stage(0) == [first, ahead] and table.at_stage(0) is first
    assert table.discard(first) == [first, ahead] and not table
    first = table.start(3, first.plan, now=1.0)
    ahead = table.start(4, lookahead_plan(s, first.plan, 3), now=1.5)
    table.finish(first)
    table.started_after(3, now=9.0)  # it waited behind step 3: its deadline and step time run from here
    assert list(table) == [ahead] and ahead.started_s == ahead.sent_s == 9.0
