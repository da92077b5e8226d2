import numpy as np

from moebus.cuda.kernels.sampling import sample_cuda, sample_ref
from tests.cuda.conftest import device, poisoned

VOCAB = 96


def _sample(logits, temperature, top_k, top_p, u):
    arrays = [np.asarray(a, dtype) for a, dtype in ((temperature, np.float32), (top_k, np.int32),
                                                     (top_p, np.float32), (u, np.float32))]
    rows = len(logits)
    tokens, logprobs = poisoned((rows,), np.int32), poisoned((rows,))
    sample_cuda(device(logits), *(device(a) for a in arrays), tokens, logprobs, poisoned((rows, VOCAB)))
    return (tokens.copy_to_host(), logprobs.copy_to_host()), sample_ref(logits, *arrays)


def test_greedy_takes_the_lowest_id_of_a_tie(rng):
    logits = rng.standard_normal((2, VOCAB), dtype=np.float32)
    logits[0, [40, 11, 70]] = 9.0
    (tokens, logprobs), (ref_tokens, ref_logprobs) = _sample(logits, [0, -1], [0, 5], [1, 0.5], [0.3, 0.9])
    assert tokens[0] == 11
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)


def test_temperature_top_k_top_p_as_the_reference(rng):
    # rows: temperature only, top-k, top-p, both, and u close to 1 (the last kept id)
    logits = rng.standard_normal((5, VOCAB), dtype=np.float32) * 2
    (tokens, logprobs), (ref_tokens, ref_logprobs) = _sample(
        logits, [0.8, 1.0, 1.3, 0.7, 1.0], [0, 7, 0, 20, 3], [1.0, 1.0, 0.6, 0.9, 1.0], [0.42, 0.5, 0.77, 0.1, 0.99999])
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)


def test_rows_reduced_over_several_spans_as_over_one(rng, monkeypatch):
    # row_stats in spans of 16 ids: a tie across spans takes the lowest id, whole spans of -inf add
    # nothing, and a temperature row still sees the whole row
    from moebus.cuda.kernels import sampling

    monkeypatch.setattr(sampling, "STATS_SPAN", 16)
    logits = rng.standard_normal((3, VOCAB), dtype=np.float32)
    logits[0, [70, 40, 21]] = 9.0
    logits[1, :32] = -np.inf
    (tokens, logprobs), (ref_tokens, ref_logprobs) = _sample(logits, [0, 0, 0.9], [0, 0, 5], [1, 1, 0.8],
                                                             [0.3, 0.9, 0.6])
    assert tokens[0] == 21
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)
