"""The chunk attention's parts around its tensor-core kernel (attention_chunk.py): the tile table, its
check, the decode rows' positions, the refusal of a float32 cache, and the stage's setting; the
kernel itself is tested in test_attention_chunk_tc.py (on a GPU)."""
import numpy as np
import pytest

from moebus.cuda.kernels.attention_chunk import (attention_tiles_cuda, check_tiles, chunk_tiles, decode_positions,
                                                 max_tiles)
from tests.cuda.conftest import device, poisoned


def _step(segments):
    """token_slot, token_pos of a step of (slot, start, length) sequences, and its stage segments."""
    slots = np.concatenate([np.full(n, s, np.int32) for s, _, n in segments])
    positions = np.concatenate([np.arange(p, p + n, dtype=np.int32) for _, p, n in segments])
    firsts = np.cumsum([0] + [n for _, _, n in segments])[:-1]
    return slots, positions, [(int(f), s, p, n) for f, (s, p, n) in zip(firsts, segments)]


def test_tiles_cover_each_sequence_in_runs_of_rows_and_pad_to_a_fixed_count():
    _, _, segments = _step([(2, 40, 1), (0, 3, 5), (1, 9, 1)])
    tiles = chunk_tiles(segments, 7, rows=2)
    assert tiles.shape == (max_tiles(7, 3, 2), 3) == (5, 3)
    np.testing.assert_array_equal(tiles, [[0, 1, 2], [1, 2, 0], [3, 2, 0], [5, 1, 0], [6, 1, 1]])
    # the fewest tiles for 7 rows in 3 sequences, whatever the lengths: the table keeps its size
    assert all(len(chunk_tiles(_step(s)[2], 7, 2)) == 5 for s in ([(0, 0, 5), (1, 0, 1), (2, 0, 1)],
                                                                   [(0, 0, 3), (1, 0, 3), (2, 0, 1)]))


def test_a_table_that_misses_a_row_or_mixes_slots_is_refused():
    slots, positions, segments = _step([(0, 3, 4), (1, 9, 1)])
    tiles = chunk_tiles(segments, 5, rows=4)
    check_tiles(tiles, slots, positions, max_rows=4)
    with pytest.raises(ValueError, match="exactly once"):
        check_tiles(tiles[:1], slots, positions, max_rows=4)
    bad = tiles.copy()
    bad[0, 2] = 1
    with pytest.raises(ValueError, match="slot"):
        check_tiles(bad, slots, positions, max_rows=4)


def test_decode_rows_keep_their_positions_and_a_chunk_reads_key_zero():
    # the decode kernel's positions: a one-row tile's own, 0 for a chunk's rows (the tensor-core
    # kernel's); padding tiles (0 rows) write nothing
    _, positions, segments = _step([(2, 40, 1), (0, 3, 5), (1, 9, 1)])
    tiles = np.vstack([chunk_tiles(segments, 7, rows=2), np.zeros((2, 3), np.int32)])
    out = poisoned((7,), np.int32)
    decode_positions[1, 64](device(tiles), 2, device(positions), out)
    np.testing.assert_array_equal(out.copy_to_host(), [40, 0, 0, 0, 0, 7, 9])


def test_a_float32_cache_is_refused():
    q = np.zeros((2, 2, 32), np.float32)
    cache = np.zeros((1, 1, 4, 32), np.float32)
    with pytest.raises(ValueError, match="bf16 caches"):
        attention_tiles_cuda(device(q), device(cache), device(cache), device(np.array([[0, 2, 0]], np.int32)),
                             device(np.zeros(2, np.int32)), device(np.arange(2, dtype=np.int32)), 0.35,
                             poisoned(q.shape))


# -- the stage: a routed step with a chunk beside decode rows --------------------------------------

@pytest.fixture(scope="module")
def micro32_model(tmp_path_factory):
    """test_e2e's micro model with head_dim 32 (group 2: a tile of 32 rows on tensor cores)."""
    from tests.cuda.test_e2e import init_micro

    return init_micro(tmp_path_factory, "micro32", head_dim=32)


def _mixed_steps(model, prompt, steps=2):
    """Two sequences decode while a third's prompt is read 3 tokens a step; the logits of each step."""
    from moebus.workers.batch import StepBatch

    out = model.step(StepBatch(slots=[0, 1], starts=[0, 0], lengths=[3, 2], tokens=[5, 17, 42, 9, 77]))
    last, seen = [int(t) for t in out.tokens], []
    for n in range(steps):
        batch = StepBatch(slots=[0, 1, 2], starts=[3 + n, 2 + n, 3 * n], lengths=[1, 1, 3],
                          tokens=last + prompt[3 * n:3 * n + 3])
        out = model.step(batch, want_logits=True)
        seen.append(out.logits.copy())
        last = [int(t) for t in out.tokens[:2]]
    return seen


def test_the_setting_switches_the_chunk_attention_off_and_the_numba_kernel_is_gone(micro32_model, monkeypatch):
    from moebus.workers.batch import StepBatch
    from moebus.workers.local import LocalModel

    batch = StepBatch(slots=[0, 1], starts=[4, 0], lengths=[1, 3], tokens=[5, 17, 42, 9])
    monkeypatch.delenv("MOEBUS_CHUNK_ATTENTION", raising=False)  # tc by default: the cpu device checks its tables
    on = LocalModel(micro32_model, device="cpu", num_slots=2, max_context=32, kv_dtype="bf16").stages[0]
    np.testing.assert_array_equal(on._host_inputs(batch, None)["attn_tiles"], [[0, 1, 0], [1, 3, 1]])
    monkeypatch.setenv("MOEBUS_CHUNK_ATTENTION", "0")
    off = LocalModel(micro32_model, device="cpu", num_slots=2, max_context=32, kv_dtype="bf16").stages[0]
    assert off.tile_rows == 0 and "attn_tiles" not in off._host_inputs(batch, None)
    monkeypatch.setenv("MOEBUS_CHUNK_ATTENTION", "1")  # the numba tile kernel: removed (eleventh session)
    with pytest.raises(ValueError, match="was removed"):
        LocalModel(micro32_model, device="cpu", num_slots=2, max_context=32)
