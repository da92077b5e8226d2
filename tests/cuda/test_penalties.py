"""The logit-rules kernels against their numpy references (simulator, tiny shapes)."""
import numpy as np
import pytest

from moebus.cuda.kernels.penalties import (LogitRules, apply_rules_cuda, apply_rules_ref, token_logprobs_cuda,
                                   token_logprobs_ref)
from tests.cuda.conftest import device, poisoned

VOCAB = 80


def _rules(rng, num_rows, lengths, params):
    ids = np.concatenate([rng.choice(VOCAB, n, replace=False) for n in lengths]).astype(np.int32)
    counts = rng.integers(-1, 4, len(ids)).astype(np.int32)
    bias = np.where(counts < 0, rng.uniform(-5, 5, len(ids)), rng.choice([0.0, 2.5], len(ids))).astype(np.float32)
    return LogitRules.from_lengths(np.asarray(params, np.float32).reshape(num_rows, 4), lengths, ids, counts, bias)


def _run(logits, temperature, rules):
    out = poisoned(logits.shape)
    apply_rules_cuda(device(logits), device(temperature), device(rules.params), device(rules.offsets),
                     device(rules.ids), device(rules.counts), device(rules.bias), out)
    return out.copy_to_host()


def test_rules_as_the_reference(rng):
    # rows: every rule at once; penalties without min_p; greedy (min_p has no effect); nothing at all
    logits = (rng.standard_normal((4, VOCAB)) * 3).astype(np.float32)
    temperature = np.array([0.7, 1.0, 0.0, 1.2], np.float32)
    params = [[0.5, 0.3, 1.3, 0.1], [-0.4, 1.0, 0.8, 0.0], [1.0, 1.0, 1.5, 0.5], [0, 0, 1, 0]]
    rules = _rules(rng, 4, [12, 7, 5, 0], params)
    got, want = _run(logits, temperature, rules), apply_rules_ref(logits, temperature, rules)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert np.isneginf(want[0]).any() and not np.isneginf(want[1:]).any()  # min_p masked row 0 only
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(want[3], logits[3])


def test_only_biased_ids_get_no_penalty(rng):
    logits = np.full((1, VOCAB), 2.0, np.float32)
    rules = LogitRules.from_lengths([[1.0, 1.0, 2.0, 0.0]], [3], [5, 6, 7], [-1, 0, 2], [1.0, 0.0, 0.0])
    out = _run(logits, np.ones(1, np.float32), rules)
    assert out[0, 5] == 3.0  # biased only
    assert out[0, 6] == 1.0  # prompt only: repetition 2.0 divides a positive logit
    assert out[0, 7] == 1.0 - 2.0 - 1.0  # output twice: repetition, then frequency x 2 and presence
    assert np.all(np.delete(out[0], [5, 6, 7]) == 2.0)


def test_token_logprobs_as_the_reference(rng):
    logits = (rng.standard_normal((3, VOCAB)) * 4).astype(np.float32)
    tokens = np.array([0, 41, VOCAB - 1], np.int32)
    out = poisoned((3,))
    token_logprobs_cuda(device(logits), device(tokens), out)
    np.testing.assert_allclose(out.copy_to_host(), token_logprobs_ref(logits, tokens), atol=1e-5)


def test_take_keeps_each_rows_entries(rng):
    rules = _rules(rng, 3, [2, 0, 3], np.arange(12) / 10 + 0.5)
    part = rules.take(np.array([2, 0]))
    np.testing.assert_array_equal(part.offsets, [0, 3, 5])
    np.testing.assert_array_equal(part.ids, np.concatenate([rules.ids[2:5], rules.ids[0:2]]))
    np.testing.assert_array_equal(part.params, rules.params[[2, 0]])


@pytest.mark.parametrize("ids, params, message", [([VOCAB], [0, 0, 1, 0], "vocabulary"),
                                                  ([-1], [0, 0, 1, 0], "vocabulary"),
                                                  ([3], [0, 0, 0, 0], "repetition")])
def test_bad_rules_are_refused_before_a_launch(ids, params, message):
    rules = LogitRules.from_lengths([params], [1], ids, [0], [0.0])
    with pytest.raises(ValueError, match=message):
        apply_rules_ref(np.zeros((1, VOCAB), np.float32), np.ones(1, np.float32), rules)


def test_backends_agree(rng):
    from moebus.cuda.backends.cpu import CpuBackend
    from moebus.cuda.backends.cuda import CudaBackend

    logits = (rng.standard_normal((2, VOCAB)) * 3).astype(np.float32)
    temperature = np.array([1.0, 0.5], np.float32)
    rules = _rules(rng, 2, [4, 3], [[0.5, 0.2, 1.4, 0.05], [0, 0, 1, 0.2]])
    gpu, cpu = CudaBackend(), CpuBackend()
    gpu.begin_step()
    adjusted = gpu.apply_rules(gpu.upload(logits), gpu.upload(temperature), rules)
    want = cpu.apply_rules(logits, temperature, rules)
    got = gpu.to_host(adjusted)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6, atol=1e-6)
    tokens = np.array([3, 9], np.int32)
    np.testing.assert_allclose(gpu.to_host(gpu.token_logprobs(gpu.upload(logits), gpu.upload(tokens))),
                               cpu.token_logprobs(logits, tokens), atol=1e-5)
