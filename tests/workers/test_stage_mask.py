"""The last stage samples a constrained row inside its allowed-token bitmask, leaves the other rows
as they were, and reports raw logprobs; a prefill split into pieces keeps each row's mask."""
import numpy as np

from moebus.cuda.kernels.penalties import token_logprobs_ref
from moebus.cuda.kernels.sampling import mask_words
from moebus.workers.batch import StepBatch, split_tokens
from moebus.workers.local import LocalModel


def _mask(vocab: int, allowed: list[int]) -> np.ndarray:
    bits = np.zeros(mask_words(vocab) * 32, np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.uint32)


def test_mask_steers_one_row_only_and_logprobs_stay_raw(tiny_model):
    model = LocalModel(tiny_model, parts=2, max_context=64)
    vocab = model.ckpt.config.vocab_size
    prompts = [[5, 9, 13], [7, 7, 7, 8], [11, 12]]
    batch = dict(slots=[0, 1, 2], starts=[0, 0, 0], lengths=[3, 4, 2], tokens=np.concatenate(prompts),
                 temperature=[0.0, 0.0, 0.0])
    plain = model.step(StepBatch(**batch), want_logits=True)
    allowed = [t for t in (60, 61, 200) if t != plain.tokens[2]]
    # row 2 constrained (mask row 0), rows 0 and 1 not
    out = model.step(StepBatch(**batch, mask=_mask(vocab, allowed)[None], mask_rows=[-1, -1, 0]), want_logits=True)
    assert out.tokens[2] == allowed[int(np.argmax(plain.logits[2, allowed]))]
    np.testing.assert_array_equal(out.tokens[:2], plain.tokens[:2])
    np.testing.assert_allclose(out.logprobs, token_logprobs_ref(plain.logits, out.tokens), atol=1e-5)


def test_split_pieces_keep_the_mask_of_rows_that_sample_in_them():
    mask = np.arange(6, dtype=np.uint32).reshape(2, 3)
    batch = StepBatch(slots=[0, 1], starts=[0, 0], lengths=[5, 3], tokens=np.arange(8), mask=mask, mask_rows=[1, 0])
    pieces = split_tokens(batch, 4)
    rows = [piece.mask_rows.tolist() for piece, *_ in pieces]
    assert rows == [[-1], [1, 0]]  # row 0's last token is in the second piece: it samples there
    full = pieces[1][0].mask_inputs()
    assert full["mask"].tolist() == [mask[1].tolist(), mask[0].tolist()] and full["mask_rows"].tolist() == [0, 1]
