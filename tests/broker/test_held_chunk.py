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


def image_seq(tokenizer, sid: str, n: int = 100, dim: int = 8) -> Sequence:
    """A prompt of ``n`` tokens whose tokens 10..59 are an image's (embeddings row i = i)."""
    s = seq(tokenizer, sid, range(3, 3 + n))
    s.embed_positions = np.arange(10, 60, dtype=np.int32)
    s.embeds = np.repeat(np.arange(50, dtype=np.float32)[:, None], dim, axis=1)
    return s


def held_step(tokenizer, cap=None):
    """``a`` decodes; ``b``'s image prompt was fed beside it and answered pending: the ordinary step
    after that, and the look-ahead step that ``b`` sat out."""
    s = Scheduler(max_batch=4, max_queue=4, max_step_tokens=512, max_prefill_tokens_beside_decode=cap)
    s.submit(seq(tokenizer, "a", [5, 6, 7]))
    first = s.plan()
    s.advance(first)
    first.seqs[0].accept(40, 0.0)
    s.submit(image_seq(tokenizer, "b"))
    step = s.plan()
    ahead = lookahead_plan(s, step, 7, chunks_span=True)  # b sits it out
    s.advance(step, pending_rows={1})
    step.seqs[0].accept(41, 0.0)
    return s, step, ahead


def message(plan, step_id=9):
    from moebus.broker.inflight import InflightStep
    from moebus.broker.steps import step_message

    return step_message(InflightStep(step_id, plan, stage=0, started_s=0.0), None, num_stages=1)


def test_a_held_chunk_goes_again_without_its_image_rows_where_kept(tokenizer, monkeypatch):
    from moebus.broker import steps

    s, _, _ = held_step(tokenizer)
    again = s.plan()
    monkeypatch.setattr(steps, "KEEP_HELD_FEED", False)
    sent = message(again)
    assert sent.held_row is None and sent.embeds.shape == (50, 8)  # the switch off: re-sent, as before
    monkeypatch.setattr(steps, "KEEP_HELD_FEED", True)
    sent = message(again)
    assert sent.held_row == 1 and sent.embeds is None and sent.embed_rows is None
    assert sent.tokens.tolist() == [41] + list(range(3, 103))  # the ids still travel (3 bytes a token)
    s.advance(again)  # answered done: b decodes, nothing is held
    assert s.running["b"].held_feed == 0 and message(again).held_row is None


def test_the_held_chunk_continues_in_the_look_ahead_step_after_the_one_it_sat_out(tokenizer, monkeypatch):
    from moebus.broker import lookahead

    s, step, ahead = held_step(tokenizer)
    assert [q.id for q in ahead.seqs] == ["a"]
    monkeypatch.setattr(lookahead, "HELD_CHUNK_AHEAD", False)
    assert lookahead_plan(s, ahead, 8, chunks_span=True) is None  # off: the ordinary step after its reply
    monkeypatch.setattr(lookahead, "HELD_CHUNK_AHEAD", True)
    assert lookahead_plan(s, ahead, 8, chunks_span=False) is None  # no chunk can be held
    nxt = lookahead_plan(s, ahead, 8, chunks_span=True)
    ordinary = s.plan()  # what the ordinary step would have fed, but a's token (the look-ahead's)
    assert [q.id for q in nxt.seqs] == ["a", "b"] and nxt.held_row == 1 and nxt.tokens_from == 8
    assert nxt.lengths.tolist() == [1, 100] and nxt.starts.tolist() == [ahead.starts[0] + 1, 0]
    assert nxt.tokens_rows.tolist() == [0, 0] and nxt.samples == [True, True]
    assert nxt.u[1] == step.u[1] == ordinary.u[1]  # the held draw
    for name in ("slots", "temperature", "top_k", "top_p"):
        assert getattr(nxt, name).tolist() == getattr(ordinary, name).tolist(), name
    sent = message(nxt)
    assert sent.tokens is None and sent.embeds is None and sent.held_row == 1 and sent.tokens_rows.tolist() == [0, 0]
    # the step after it leaves the chunk out again (still held until its answer)
    assert [q.id for q in lookahead_plan(s, nxt, 9, chunks_span=True).seqs] == ["a"]


def test_no_held_chunk_look_ahead_for_a_sequence_the_host_must_see_first(tokenizer, monkeypatch):
    from moebus.broker import lookahead

    monkeypatch.setattr(lookahead, "HELD_CHUNK_AHEAD", True)
    s, _, ahead = held_step(tokenizer)
    b = s.running["b"]
    b.sampling = Sampling(max_tokens=8, presence_penalty=0.5)  # logit rules: its row needs the host
    assert lookahead_plan(s, ahead, 8, chunks_span=True) is None
    b.sampling = Sampling(max_tokens=8)
    b.held_feed = 0  # answered done: it joins at the ordinary step
    assert lookahead_plan(s, ahead, 8, chunks_span=True) is None
