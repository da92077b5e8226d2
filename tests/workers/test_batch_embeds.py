"""StepBatch image embeddings: checked on construction, carried into the pieces of a split step."""
import numpy as np
import pytest

from moebus.workers.batch import StepBatch, split_tokens


def batch_with_embeds():
    # two sequences of 5 and 4 tokens; image rows 1, 2 (first) and 6, 8 (second)
    rows = np.array([1, 2, 6, 8], np.int32)
    embeds = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    return StepBatch(slots=[0, 1], starts=[0, 0], lengths=[5, 4], tokens=np.arange(9), embeds=embeds,
                     embed_rows=rows)


def test_split_pieces_carry_only_their_rows_renumbered():
    batch = batch_with_embeds()
    seen = []
    for piece, _, _, tokens in split_tokens(batch, 3):
        assert piece.embeds.shape == (len(piece.embed_rows), 3)
        seen += [(tokens.start + int(r), tuple(e)) for r, e in zip(piece.embed_rows, piece.embeds)]
        assert all(0 <= r < piece.num_tokens for r in piece.embed_rows)
    assert seen == [(int(r), tuple(e)) for r, e in zip(batch.embed_rows, batch.embeds)]


def test_split_without_embeds_has_none():
    batch = StepBatch(slots=[0], starts=[0], lengths=[4], tokens=np.arange(4))
    assert all(piece.embeds is None for piece, _, _, _ in split_tokens(batch, 3))


@pytest.mark.parametrize("rows, embeds, match", [
    ([0, 9], np.zeros((2, 3)), "distinct rows"), ([1, 1], np.zeros((2, 3)), "distinct rows"),
    ([0, 1], np.zeros((3, 3)), "do not match"), (None, np.zeros((2, 3)), "together")])
def test_bad_embed_rows_are_refused(rows, embeds, match):
    with pytest.raises(ValueError, match=match):
        StepBatch(slots=[0], starts=[0], lengths=[9], tokens=np.arange(9), embeds=embeds, embed_rows=rows)
