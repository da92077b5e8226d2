import numpy as np
import pytest

from moebus.broker.scheduler import Scheduler
from moebus.broker.sequence import Sequence
from moebus.common.errors import ServerBusy
from moebus.common.protocol import Sampling
from moebus.common.tokenizer import StreamDecoder, TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return TextTokenizer(tiny_model)


def seq(tokenizer, sid, prompt, **sampling):
    return Sequence(id=sid, client=b"c", prompt=list(prompt), sampling=Sampling(**{"max_tokens": 5, **sampling}),
                    decoder=StreamDecoder(tokenizer), stop_ids=frozenset({2}), max_context=64)


def test_fifo_admission_slots_and_chunked_prefill(tokenizer):
    s = Scheduler(max_batch=2, max_queue=2, max_step_tokens=4)
    a, b, c = seq(tokenizer, "a", range(10, 16)), seq(tokenizer, "b", [7]), seq(tokenizer, "c", [8])
    s.submit(a)
    s.submit(b)
    with pytest.raises(ServerBusy):
        s.submit(c)  # two wait already (nothing is admitted before a step is planned)
    step = s.plan()  # a prefills its first 4 tokens, which is the whole step budget
    assert [x.id for x in step.seqs] == ["a"] and step.tokens.tolist() == [10, 11, 12, 13]
    assert step.samples == [False] and step.u[0] == 0.0  # no draw consumed mid-prompt
    s.advance(step)
    step = s.plan()
    assert [x.id for x in step.seqs] == ["a", "b"] and step.lengths.tolist() == [2, 1]
    assert step.starts.tolist() == [4, 0] and step.samples == [True, True]
    assert sorted(step.slots.tolist()) == [0, 1]
    s.advance(step)
    a.accept(42, 0.0)
    b.accept(43, 0.0)
    step = s.plan()  # both decode now: one token each, at their positions
    assert step.tokens.tolist() == [42, 43] and step.starts.tolist() == [6, 1]
    s.remove(b)
    assert s.free_slots and not s.find("b")


def test_seeded_draws_do_not_depend_on_batching(tokenizer):
    solo = Scheduler(4, 4, 64)
    x = seq(tokenizer, "x", [1, 2, 3], seed=7, temperature=1.0)
    solo.submit(x)
    draws_solo = [solo.plan().u[0] for _ in range(1)]
    crowd = Scheduler(4, 4, 2)
    y = seq(tokenizer, "y", [1, 2, 3], seed=7, temperature=1.0)
    crowd.submit(seq(tokenizer, "z", [9] * 5))
    crowd.submit(y)
    draws = []
    while len(draws) < 1:
        step = crowd.plan()
        crowd.advance(step)
        for q, u, take in zip(step.seqs, step.u, step.samples):
            if take:
                q.accept(50, 0.0)
                draws += [u] if q.id == "y" else []
    assert np.float32(draws[0]) == np.float32(draws_solo[0])


def test_stop_rules(tokenizer):
    s = seq(tokenizer, "s", [1], max_tokens=3)
    for t in (30, 31):
        s.accept(t, 0.0)
    assert s.finish_reason is None
    s.accept(32, 0.0)
    assert s.finish_reason == "length"
    e = seq(tokenizer, "e", [1])
    e.accept(2, 0.0)  # eos
    assert e.finish_reason == "stop"
    ig = seq(tokenizer, "i", [1], ignore_eos=True)
    ig.accept(2, 0.0)
    assert ig.finish_reason is None


def test_stop_string_is_cut_and_held_back(tokenizer):
    ids = tokenizer.encode("the model expert cache")
    s = seq(tokenizer, "s", [1], max_tokens=50, stop=["expert"])
    streamed = "".join(s.accept(t, 0.0) for t in ids if s.finish_reason is None)
    assert s.finish_reason == "stop" and streamed == "the model " and "exp" not in streamed


def test_plain_steps_carry_no_logit_rules(tokenizer):
    s = Scheduler(max_batch=2, max_queue=2, max_step_tokens=16)
    s.submit(seq(tokenizer, "a", [5, 6]))
    assert s.plan().logit_rules is None


def test_logit_rules_carry_each_rows_history_and_bias(tokenizer):
    s = Scheduler(max_batch=3, max_queue=3, max_step_tokens=16)
    plain = seq(tokenizer, "plain", [5, 6])
    pen = seq(tokenizer, "pen", [9, 7, 9], repetition_penalty=1.2, frequency_penalty=0.5, logit_bias=[(7, 1.0),
                                                                                                     (30, -2.0)])
    only_bias = seq(tokenizer, "bias", [4], logit_bias=[(11, 3.0)], min_p=0.1)
    for x in (plain, pen, only_bias):
        s.submit(x)
    s.advance(s.plan())
    pen.accept(9, 0.0)
    pen.accept(12, 0.0)
    pen.accept(9, 0.0)
    plain.accept(8, 0.0)
    only_bias.accept(8, 0.0)
    step = s.plan()
    rules = step.logit_rules
    rows = [x.id for x in step.seqs]
    assert rules["logit_lengths"].tolist() == [[0, 4, 1][["plain", "pen", "bias"].index(r)] for r in rows]
    np.testing.assert_allclose(rules["logit_params"][rows.index("pen")], [0.5, 0.0, 1.2, 0.0])
    np.testing.assert_allclose(rules["logit_params"][rows.index("bias")], [0.0, 0.0, 1.0, 0.1])
    start = int(rules["logit_lengths"][: rows.index("pen")].sum())
    entries = {int(t): (int(c), float(b)) for t, c, b in zip(*(rules[k][start:start + 4] for k in
                                                                ("logit_ids", "logit_counts", "logit_bias")))}
    # 7 prompt only (biased), 9 prompt and twice in the output, 12 once, 30 biased only
    assert entries == {7: (0, 1.0), 9: (2, 0.0), 12: (1, 0.0), 30: (-1, -2.0)}


def test_only_rows_that_sample_and_asked_get_top_logprobs(tokenizer):
    s = Scheduler(max_batch=3, max_queue=3, max_step_tokens=8)
    plain, asks, long = seq(tokenizer, "p", [5]), seq(tokenizer, "a", [6], logprobs=3), \
        seq(tokenizer, "l", range(10, 30), logprobs=5)
    for x in (plain, asks, long):
        s.submit(x)
    step = s.plan()  # "l" prefills a chunk: it does not sample, so it does not ask yet
    assert [x.id for x in step.seqs] == ["p", "a", "l"] and step.samples == [True, True, False]
    assert step.logprob_rows.tolist() == [1] and step.top_logprobs == 3
    s.advance(step)
    s.remove(asks)
    plain.accept(1, 0.0)
    step = s.plan()
    assert [x.id for x in step.seqs] == ["p", "l"] and step.samples == [True, False]
    assert step.logprob_rows.tolist() == [] and step.top_logprobs == 0  # nobody pays this step
