"""Which rows of a step carry image embeddings: a prefill chunk carries exactly the image tokens
inside it, at their row among the step's T tokens (sequences laid end to end), decode steps none."""
import numpy as np

from moebus.broker.vision_requests import step_embeds


class _Seq:
    def __init__(self, positions, dim=4, offset=0.0):
        self.embed_positions = np.array(positions, np.int32)
        self.embeds = None if not positions else \
            offset + np.arange(len(positions) * dim, dtype=np.float32).reshape(len(positions), dim)


def test_chunks_carry_only_their_own_image_rows():
    seq = _Seq([2, 3, 4, 5, 6])  # image tokens at prompt positions 2..6
    text = _Seq([])
    chunks = [(0, 4), (4, 4), (8, 4)]  # a 12-token prompt in chunks of 4
    got = []
    for start, length in chunks:
        embeds, rows = step_embeds([text, seq], [10, start], [1, length])  # a decoding text sequence first
        got.append((None if rows is None else rows.tolist(), embeds))
    assert got[0][0] == [1 + 2, 1 + 3]  # positions 2, 3 of chunk [0, 4), after the text sequence's one row
    assert got[1][0] == [1 + 0, 1 + 1, 1 + 2]  # positions 4, 5, 6 of chunk [4, 8)
    assert got[2][0] is None
    np.testing.assert_array_equal(np.concatenate([got[0][1], got[1][1]]), seq.embeds)


def test_two_image_sequences_in_one_step():
    a, b = _Seq([0, 1], offset=0.0), _Seq([2], offset=100.0)
    embeds, rows = step_embeds([a, b], [0, 0], [3, 4])
    assert rows.tolist() == [0, 1, 3 + 2] and rows.dtype == np.int32
    np.testing.assert_array_equal(embeds, np.concatenate([a.embeds, b.embeds]))
    assert step_embeds([a], [3], [1]) == (None, None)  # decoding past the prompt


def test_default_hand_back_per_device():
    from moebus.broker.vision import default_vram_mib

    assert default_vram_mib("cuda", 1, 0, 0) == [1800]
    assert default_vram_mib("cuda", 2, 0, 0) == [1700, 600]
    assert default_vram_mib("cuda", 2, 1, 0) == [600, 1700]
    # cpu: what the worker charges, rounded up to whole MiB, plus one; only on the vision GPU
    assert default_vram_mib("cpu", 2, 0, 15 * (1 << 20) + 1) == [17, 0]
    assert default_vram_mib("cpu", 2, 1, 3 * (1 << 20)) == [0, 4]


def test_one_image_prompt_in_a_step_sends_its_rows_without_a_copy():
    seq = _Seq([2, 3, 4, 5, 6])
    out, rows = step_embeds([seq], [3], [3])  # tokens 3..5: image rows 1..3
    assert np.shares_memory(out, seq.embeds) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, seq.embeds[1:4])
    assert rows.dtype == np.int32 and list(rows) == [0, 1, 2]
