import numpy as np
import pytest

from moebus.cuda.backends.graphs import graphs_available
from moebus.cuda.dtypes import f32_to_bf16
from moebus.cuda.kernels.attention import SPLIT_POSITIONS, attention_cuda, attention_ref
from moebus.cuda.kernels.attention_chunk import (attention_tiles_cuda, attention_tiles_ref, check_tiles, chunk_tiles,
                                                 max_tiles, rows_per_tile)
from tests.cuda.conftest import device, poisoned

SLOTS, HEAD_DIM = 3, 32


def _cache(rng, kv_heads, context, kv_dtype):
    values = rng.standard_normal((SLOTS, kv_heads, context, HEAD_DIM), dtype=np.float32)
    return f32_to_bf16(values) if kv_dtype == "bf16" else values


def _step(segments):
    """token_slot, token_pos of a step of (slot, start, length) sequences, and its stage segments."""
    slots = np.concatenate([np.full(n, s, np.int32) for s, _, n in segments])
    positions = np.concatenate([np.arange(p, p + n, dtype=np.int32) for _, p, n in segments])
    firsts = np.cumsum([0] + [n for _, _, n in segments])[:-1]
    return slots, positions, [(int(f), s, p, n) for f, (s, p, n) in zip(firsts, segments)]


def _attend(q, k_cache, v_cache, tiles, positions, slots):
    out = poisoned(q.shape)
    attention_tiles_cuda(device(q), device(k_cache), device(v_cache), device(tiles), device(slots), device(positions),
                         0.35, out)
    return out.copy_to_host()


def test_tiles_cover_each_sequence_in_runs_of_rows_and_pad_to_a_fixed_count():
    _, _, segments = _step([(2, 40, 1), (0, 3, 5), (1, 9, 1)])
    tiles = chunk_tiles(segments, 7, rows=2)
    assert tiles.shape == (max_tiles(7, 3, 2), 3) == (5, 3)
    np.testing.assert_array_equal(tiles, [[0, 1, 2], [1, 2, 0], [3, 2, 0], [5, 1, 0], [6, 1, 1]])
    # the fewest tiles for 7 rows in 3 sequences, whatever the lengths: the table keeps its size
    assert all(len(chunk_tiles(_step(s)[2], 7, 2)) == 5 for s in ([(0, 0, 5), (1, 0, 1), (2, 0, 1)],
                                                                   [(0, 0, 3), (1, 0, 3), (2, 0, 1)]))
    # A3B (group 8, hd 128): 5 rows (40 pairs); a group of 4: 11; micro32 (group 2, hd 32): 32 (64 pairs)
    assert rows_per_tile(8, 128) == 5 and rows_per_tile(4, 128) == 11 and rows_per_tile(2, 32) == 32
    assert rows_per_tile(64, 128) == 0  # not one row: the decode kernel


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


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (2, 2), (8, 1)])
def test_a_chunk_beside_decode_rows_matches_the_reference(rng, heads, kv_heads, kv_dtype):
    # a chunk of 5 rows past the first split (several splits, a causal edge inside the last key
    # tile) between two decode rows, one of them at position 0
    context = 3 * SPLIT_POSITIONS
    k_cache, v_cache = _cache(rng, kv_heads, context, kv_dtype), _cache(rng, kv_heads, context, kv_dtype)
    slots, positions, segments = _step([(2, 70, 1), (0, SPLIT_POSITIONS + 20, 5), (1, 0, 1)])
    rows = min(4, rows_per_tile(heads // kv_heads, HEAD_DIM))  # the chunk in two tiles
    q = rng.standard_normal((len(slots), heads, HEAD_DIM), dtype=np.float32)
    tiles = chunk_tiles(segments, len(slots), rows)
    expected = attention_ref(q, k_cache, v_cache, slots, positions, 0.35)
    np.testing.assert_allclose(attention_tiles_ref(q, k_cache, v_cache, tiles, slots, positions, 0.35), expected,
                               rtol=1e-6, atol=1e-6)
    got = _attend(q, k_cache, v_cache, tiles, positions, slots)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    decode = poisoned(q.shape)  # the decode rows (0 and 6) on the decode kernel, as in a step without the chunk
    attention_cuda(device(q), device(k_cache), device(v_cache), device(slots), device(positions), 0.35, 0, decode)
    np.testing.assert_array_equal(got[[0, 6]], decode.copy_to_host()[[0, 6]])


def test_a_chunk_from_position_zero_sees_only_the_keys_before_it(rng):
    # a prompt's first chunk: row r sees keys [0, r]; keys past the chunk hold garbage (never read)
    context = SPLIT_POSITIONS
    k_cache, v_cache = _cache(rng, 2, context, "fp32"), _cache(rng, 2, context, "fp32")
    k_cache[0, :, 6:] = v_cache[0, :, 6:] = np.nan
    slots, positions, segments = _step([(0, 0, 6)])
    q = rng.standard_normal((6, 4, HEAD_DIM), dtype=np.float32)
    got = _attend(q, k_cache, v_cache, chunk_tiles(segments, 6, rows=4), positions, slots)
    np.testing.assert_allclose(got, attention_ref(q, k_cache, v_cache, slots, positions, 0.35), rtol=1e-5, atol=1e-5)


def test_long_context_splits_and_key_tiles(rng):
    # splits longer than a key tile (WARP keys): a block walks two, the second one partly
    context = 2 * SPLIT_POSITIONS + 8
    k_cache, v_cache = _cache(rng, 1, context, "bf16"), _cache(rng, 1, context, "bf16")
    slots, positions, segments = _step([(1, context - 3, 3), (0, context // 2, 1)])
    q = rng.standard_normal((4, 2, HEAD_DIM), dtype=np.float32)
    got = _attend(q, k_cache, v_cache, chunk_tiles(segments, 4, rows=2), positions, slots)
    np.testing.assert_allclose(got, attention_ref(q, k_cache, v_cache, slots, positions, 0.35), rtol=1e-5, atol=1e-5)


def test_rows_that_see_no_key_of_a_split_leave_it_out_of_their_merge(rng):
    # one tile of 26 rows at 20..45: its keys [0, 46) in two splits [0, 23) and [23, 46); the rows at
    # 20-22 see nothing of the second (their (0, -inf, 0) weighs 0)
    k_cache, v_cache = _cache(rng, 2, 48, "fp32"), _cache(rng, 2, 48, "fp32")
    slots, positions, segments = _step([(1, 20, 26)])
    q = rng.standard_normal((26, 4, HEAD_DIM), dtype=np.float32)
    got = _attend(q, k_cache, v_cache, chunk_tiles(segments, 26, rows=26), positions, slots)
    np.testing.assert_allclose(got, attention_ref(q, k_cache, v_cache, slots, positions, 0.35), rtol=1e-5, atol=1e-5)


def test_unused_tiles_write_nothing(rng):
    k_cache, v_cache = _cache(rng, 1, 16, "fp32"), _cache(rng, 1, 16, "fp32")
    slots, positions, segments = _step([(0, 4, 2)])
    tiles = np.vstack([chunk_tiles(segments, 2, rows=2), np.zeros((2, 3), np.int32)])  # padding: (0, 0, 0)
    q = rng.standard_normal((2, 2, HEAD_DIM), dtype=np.float32)
    np.testing.assert_allclose(_attend(q, k_cache, v_cache, tiles, positions, slots),
                               attention_ref(q, k_cache, v_cache, slots, positions, 0.35), rtol=1e-5, atol=1e-5)


def test_a_head_dim_the_lanes_do_not_divide_is_refused(rng):
    q = np.zeros((1, 2, 8), np.float32)
    cache = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="head_dim 8"):
        attention_tiles_cuda(device(q), device(cache), device(cache), device(np.array([[0, 1, 0]], np.int32)),
                             device(np.zeros(1, np.int32)), device(np.zeros(1, np.int32)), 0.35, poisoned(q.shape))


# -- the stage: a routed step with a chunk beside decode rows --------------------------------------

@pytest.fixture(scope="module")
def micro32_model(tmp_path_factory):
    """test_e2e's micro model with head_dim 32 (the tile kernel spreads a row over 32 lanes)."""
    from moebus.common import tiny_model
    from tests.cuda.test_e2e import MICRO

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tiny_model.PRESETS, "micro32", dict(MICRO, head_dim=32))
        patch.setitem(tiny_model.PRESET_SHARDED, "micro32", False)
        return tiny_model.init_model(tmp_path_factory.mktemp("micro32"), "qwen3_moe", "micro32")


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


def test_a_chunk_beside_decode_rows_on_the_cuda_device_matches_the_cpu_device(micro32_model, monkeypatch):
    from moebus.workers.local import LocalModel

    monkeypatch.setenv("MOEBUS_CHUNK_ATTENTION", "1")
    prompt = list(range(40, 46))
    cpu = LocalModel(micro32_model, device="cpu", num_slots=3, max_context=32)
    cuda = LocalModel(micro32_model, device="cuda", num_slots=3, max_context=32)
    assert cpu.stages[0].tile_rows == cuda.stages[0].tile_rows == 32  # switched on; group 2
    called = []
    inner = cuda.backend.attention
    monkeypatch.setattr(cuda.backend, "attention", lambda *a, **k: called.append(k["tiles"] is not None) or
                        inner(*a, **k))
    for want, got in zip(_mixed_steps(cpu, prompt), _mixed_steps(cuda, prompt)):
        np.testing.assert_allclose(got, want, atol=1e-3)
    # the prompts (2 sequences of 5 tokens: routed too), 2 mixed steps; 2 layers. On a GPU the second
    # mixed step is captured: a capture runs the step's Python twice (a warm-up, then the capture)
    assert called == [True] * (3 * 2 + 2 * cuda.stages[0].graph_captures)


def test_the_setting_switches_the_numba_tile_kernel_on(micro32_model, monkeypatch):
    from moebus.workers.batch import StepBatch
    from moebus.workers.local import LocalModel

    batch = StepBatch(slots=[0, 1], starts=[4, 0], lengths=[1, 3], tokens=[5, 17, 42, 9])
    monkeypatch.delenv("MOEBUS_CHUNK_ATTENTION", raising=False)  # tc by default: off with the cpu's fp32 cache
    default = LocalModel(micro32_model, device="cpu", num_slots=2, max_context=32).stages[0]
    assert default.tile_rows == 0 and "attn_tiles" not in default._host_inputs(batch, None)
    monkeypatch.setenv("MOEBUS_CHUNK_ATTENTION", "1")
    on = LocalModel(micro32_model, device="cpu", num_slots=2, max_context=32).stages[0]
    np.testing.assert_array_equal(on._host_inputs(batch, None)["attn_tiles"], [[0, 1, 0], [1, 3, 1]])
    monkeypatch.setenv("MOEBUS_CHUNK_ATTENTION", "0")
    off = LocalModel(micro32_model, device="cpu", num_slots=2, max_context=32).stages[0]
    assert off.tile_rows == 0 and "attn_tiles" not in off._host_inputs(batch, None)


@pytest.mark.skipif(not graphs_available(), reason="CUDA graphs need a GPU")
def test_the_captured_mixed_steps_give_the_eager_ones_bits(micro32_model, monkeypatch):
    """On a GPU: the tile table is a step input, so replays of one captured shape follow the chunk."""
    from moebus.workers.local import LocalModel

    monkeypatch.setenv("MOEBUS_CHUNK_ATTENTION", "1")
    def run(graphs: bool):
        model = LocalModel(micro32_model, device="cuda", num_slots=3, max_context=32)
        model.stages[0].use_graphs = graphs and model.stages[0].use_graphs
        return model.stages[0], _mixed_steps(model, list(range(40, 52)), steps=4)

    stage, captured = run(True)
    _, eager = run(False)
    assert (5, False, 3) in stage.graphs
    for a, b in zip(captured, eager):
        np.testing.assert_array_equal(a, b)
