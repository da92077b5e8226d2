"""The allowed-token bitmask of structured outputs, applied inside the sampling kernel: the kernel
against its numpy reference (simulator by default, a GPU with MOEBUS_TEST_GPU=1), and the reference
against its definition (masked ids as -inf logits)."""
import numpy as np
import pytest

from moebus.cuda.kernels.sampling import allowed_ids, mask_words, sample_cuda, sample_ref, sample_row_ref
from tests.cuda.conftest import device, poisoned

VOCAB = 100  # not a multiple of 32: the last word is partly outside the vocabulary


def bitmask(allowed: np.ndarray) -> np.ndarray:
    """(V,) bool -> (W,) uint32, bit i % 32 of word i // 32."""
    padded = np.zeros(mask_words(len(allowed)) * 32, np.uint8)
    padded[: len(allowed)] = allowed
    return np.packbits(padded, bitorder="little").view(np.uint32)


def _sample(logits, temperature, top_k, top_p, u, mask=None, mask_rows=None):
    arrays = [np.asarray(a, dtype) for a, dtype in ((temperature, np.float32), (top_k, np.int32),
                                                     (top_p, np.float32), (u, np.float32))]
    rows = len(logits)
    tokens, logprobs = poisoned((rows,), np.int32), poisoned((rows,))
    masks = {} if mask is None else {"mask": device(mask), "mask_rows": device(np.asarray(mask_rows, np.int32))}
    sample_cuda(device(logits), *(device(a) for a in arrays), tokens, logprobs, poisoned((rows, VOCAB)), **masks)
    return (tokens.copy_to_host(), logprobs.copy_to_host()), sample_ref(logits, *arrays, mask=mask, mask_rows=mask_rows)


def test_bitmask_round_trip(rng):
    allowed = rng.random(VOCAB) < 0.3
    np.testing.assert_array_equal(allowed_ids(bitmask(allowed), VOCAB), allowed)


def test_masked_rows_as_the_reference_unmasked_rows_untouched(rng):
    # rows: greedy masked, sampled masked (top-k, top-p), an unconstrained row between them, one
    # allowed id only, allowed ids whose logits are far below the best (exp would underflow without
    # the masked peak), and a row whose allowed ids are all -inf (the lowest allowed id)
    logits = rng.standard_normal((6, VOCAB), dtype=np.float32) * 2
    allowed = [rng.random(VOCAB) < 0.2 for _ in range(5)]
    allowed[2][:] = False
    allowed[2][97] = True
    allowed[3] = np.zeros(VOCAB, bool)
    allowed[3][[5, 60, 61]] = True
    logits[3, [5, 60, 61]] -= 200.0
    allowed[4] = np.zeros(VOCAB, bool)
    allowed[4][[33, 70]] = True
    logits[5, [33, 70]] = -np.inf
    mask = np.stack([bitmask(a) for a in allowed])
    mask_rows = [0, 1, -1, 2, 3, 4]
    (tokens, logprobs), (ref_tokens, ref_logprobs) = _sample(
        logits, [0.0, 0.9, 1.0, 0.7, 1.0, 1.0], [0, 5, 0, 0, 2, 0], [1.0, 0.8, 1.0, 1.0, 1.0, 1.0],
        [0.3, 0.6, 0.5, 0.9, 0.99, 0.5], mask, mask_rows)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)
    for row, m in enumerate(mask_rows):
        if m >= 0:
            assert allowed[m][tokens[row]], f"row {row} left its mask"
    assert tokens[3] == 97
    assert tokens[5] == 33
    # the unconstrained row samples as it does without any mask in the batch
    assert tokens[2] == sample_row_ref(logits[2], 1.0, 0, 1.0, 0.5)[0]
    # logprobs are those of the raw logits
    lse = np.log(np.sum(np.exp(logits[0].astype(np.float64))))
    np.testing.assert_allclose(logprobs[0], logits[0, tokens[0]] - lse, atol=1e-5)


def test_masked_reference_is_the_minus_inf_definition(rng):
    logits = rng.standard_normal((1, VOCAB), dtype=np.float32)
    allowed = rng.random(VOCAB) < 0.5
    for temperature, top_k, top_p, u in ((0.0, 0, 1.0, 0.1), (0.8, 10, 0.9, 0.37), (1.3, 0, 0.5, 0.92)):
        token, _ = sample_ref(logits, [temperature], [top_k], [top_p], [u], mask=bitmask(allowed)[None], mask_rows=[0])
        expected, _ = sample_row_ref(np.where(allowed, logits[0], -np.inf), temperature, top_k, top_p, u)
        assert token[0] == expected


@pytest.mark.parametrize("seed", range(3))
def test_sampled_tokens_follow_the_masked_distribution(seed):
    """Many draws of one masked row: every token allowed, and frequencies as softmax over the allowed."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(VOCAB).astype(np.float32)
    allowed = np.zeros(VOCAB, bool)
    allowed[rng.choice(VOCAB, 4, replace=False)] = True
    draws = 4000
    tokens, _ = sample_ref(np.repeat(logits[None], draws, 0), np.ones(draws, np.float32), np.zeros(draws, np.int32),
                           np.ones(draws, np.float32), rng.random(draws).astype(np.float32),
                           mask=bitmask(allowed)[None], mask_rows=np.zeros(draws, np.int32))
    assert set(tokens.tolist()) <= set(np.nonzero(allowed)[0].tolist())
    p = np.exp(logits[allowed] - logits[allowed].max())
    p /= p.sum()
    counts = np.array([np.sum(tokens == t) for t in np.nonzero(allowed)[0]])
    np.testing.assert_allclose(counts / draws, p, atol=0.04)


def test_wrapper_refuses_a_mask_of_the_wrong_width():
    logits = np.zeros((1, VOCAB), np.float32)
    with pytest.raises(ValueError, match="words"):
        _sample(logits, [0.0], [0], [1.0], [0.0], np.zeros((1, 2), np.uint32), [0])
