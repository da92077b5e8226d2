"""Each logit rule checked against a definition that is not ours: transformers' logits processors
where one exists, else a per-token loop written from the OpenAI / vLLM docs; and the sampler's
distribution after every rule checked by a chi-square test over many seeded draws."""
import math
from collections import Counter

import numpy as np
import pytest

from moebus.cuda.kernels.penalties import LogitRules, apply_rules_ref
from moebus.cuda.kernels.sampling import sample_row_ref

torch = pytest.importorskip("torch")
generation = pytest.importorskip("transformers.generation.logits_process")
stats = pytest.importorskip("scipy.stats")

VOCAB = 48


def _rules(prompt, output, frequency=0.0, presence=0.0, repetition=1.0, min_p=0.0, logit_bias=None):
    """Our compact form of a request's history, built the way the broker builds it."""
    counts = Counter(output)
    bias = dict(logit_bias or {})
    history = sorted(set(prompt) | set(output)) if (frequency or presence or repetition != 1.0) else []
    ids = history + sorted(set(bias) - set(history))
    return LogitRules.from_lengths([[frequency, presence, repetition, min_p]], [len(ids)], ids,
                                   [counts[t] if t in history else -1 for t in ids], [bias.get(t, 0.0) for t in ids])


def _hf(processor, logits, input_ids=()):
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    return processor(ids, torch.tensor(logits[None], dtype=torch.float32)).numpy()[0]


def _openai_penalties(logits, output, frequency, presence):
    """OpenAI's documented formula: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence."""
    out = [float(v) for v in logits]
    for j in range(len(out)):
        c = output.count(j)
        out[j] = out[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence
    return np.array(out, np.float32)


@pytest.fixture
def case(rng):
    logits = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
    prompt = list(rng.integers(0, VOCAB, 20))
    output = list(rng.integers(0, VOCAB, 15))
    return logits, [int(t) for t in prompt], [int(t) for t in output]


def test_repetition_penalty_as_transformers(case):
    logits, prompt, output = case
    want = _hf(generation.RepetitionPenaltyLogitsProcessor(1.7), logits, prompt + output)
    got = apply_rules_ref(logits[None], np.ones(1, np.float32), _rules(prompt, output, repetition=1.7))[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_frequency_and_presence_as_openai_documents_them(case):
    logits, prompt, output = case
    want = _openai_penalties(logits, output, 0.6, 1.1)
    got = apply_rules_ref(logits[None], np.ones(1, np.float32), _rules(prompt, output, 0.6, 1.1))[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    untouched = [t for t in range(VOCAB) if t not in output]
    np.testing.assert_array_equal(got[untouched], logits[untouched])  # the prompt does not count


def test_logit_bias_as_transformers(case):
    logits, prompt, output = case
    bias = {3: 5.0, 17: -100.0, 40: 0.25}
    want = _hf(generation.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}), logits, prompt)
    got = apply_rules_ref(logits[None], np.ones(1, np.float32), _rules(prompt, output, logit_bias=bias))[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.05), (0.6, 0.2), (1.5, 0.5)])
def test_min_p_keeps_what_transformers_keeps(case, temperature, min_p):
    logits, prompt, output = case
    scaled = _hf(generation.TemperatureLogitsWarper(temperature), logits)
    want = np.isneginf(_hf(generation.MinPLogitsWarper(min_p), scaled))
    got = np.isneginf(apply_rules_ref(logits[None], np.full(1, temperature, np.float32),
                                      _rules(prompt, output, min_p=min_p))[0])
    assert want.any() and not want.all()
    np.testing.assert_array_equal(got, want)


def _oracle_probs(logits, prompt, output, temperature, top_k, top_p, frequency, presence, repetition, min_p,
                  bias):
    """The next-token distribution, in vLLM's order, from transformers' processors and the OpenAI formula."""
    x = _hf(generation.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}), logits, prompt)
    x = _hf(generation.RepetitionPenaltyLogitsProcessor(repetition), x, prompt + output)
    x = _openai_penalties(x, output, frequency, presence)
    x = _hf(generation.TemperatureLogitsWarper(temperature), x)
    x = _hf(generation.MinPLogitsWarper(min_p), x)
    x = _hf(generation.TopKLogitsWarper(top_k), x)
    x = _hf(generation.TopPLogitsWarper(top_p), x)
    return torch.softmax(torch.tensor(x), dim=-1).numpy().astype(np.float64)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.0), (0.8, 12, 0.9, 0.02),
                                                             (1.3, 0, 0.8, 0.1)])
def test_sampled_distribution_passes_a_chi_square_test(case, temperature, top_k, top_p, min_p):
    logits, prompt, output = case
    frequency, presence, repetition, bias = 0.3, 0.4, 1.2, {5: 2.0, 9: -1.0}
    rules = _rules(prompt, output, frequency, presence, repetition, min_p, bias)
    adjusted = apply_rules_ref(logits[None], np.full(1, temperature, np.float32), rules)[0]
    expected = _oracle_probs(logits, prompt, output, temperature, top_k or VOCAB, top_p, frequency, presence,
                             repetition, min_p, bias)
    draws = np.random.default_rng(1234).random(4000, dtype=np.float32)
    tokens = [sample_row_ref(adjusted, temperature, top_k, top_p, u)[0] for u in draws]
    observed = np.bincount(tokens, minlength=VOCAB)
    kept = expected > 0
    assert observed[~kept].sum() == 0  # nothing outside the allowed set is ever drawn
    # pool the rare ids so that every expected count is large enough for the chi-square approximation
    order = np.argsort(expected[kept])
    exp_k, obs_k = expected[kept][order] * len(draws), observed[kept][order].astype(np.float64)
    rare = np.cumsum(exp_k) < 5 * math.ceil(exp_k.sum() / len(draws))
    exp_k = np.append(exp_k[~rare], exp_k[rare].sum()) if rare.any() else exp_k
    obs_k = np.append(obs_k[~rare], obs_k[rare].sum()) if rare.any() else obs_k
    assert stats.chisquare(obs_k, exp_k * obs_k.sum() / exp_k.sum()).pvalue > 1e-3


def test_greedy_follows_the_rules(case):
    logits, prompt, output = case
    top = int(np.argmax(logits))
    rules = _rules(prompt, output, logit_bias={top: -100.0})
    adjusted = apply_rules_ref(logits[None], np.zeros(1, np.float32), rules)[0]
    assert sample_row_ref(adjusted, 0.0, 0, 1.0, 0.5)[0] == int(np.argsort(-logits)[1])
