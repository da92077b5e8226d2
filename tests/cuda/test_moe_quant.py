"""Quantized expert GEMVs (fp8, int4) against their numpy reference, which dequantizes the blob."""
import numpy as np
import pytest

from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.kernels import moe_ffn
from moebus.cuda.kernels.compat import cuda, float32
from moebus.cuda.kernels.moe_quant import expert_ffn_quant_cuda, expert_ffn_quant_ref
from moebus.cuda.kernels.moe_quant_bf16 import expert_weights_bf16, expert_weights_bf16_cuda
from moebus.cuda.dtypes import bf16_to_f32
from tests.cuda.conftest import device, poisoned

FORMATS = ("fp8", "int4")


@pytest.fixture(autouse=True)
def _eight_byte_kernels(monkeypatch):
    """This file's tests are moe_quant.py's own kernels' (test_moe_quant_round.py: the one-round ones)."""
    from moebus.cuda.kernels import moe_quant

    monkeypatch.setattr(moe_quant, "FP8_ONE_ROUND", False)
    monkeypatch.setattr(moe_quant, "INT4_ONE_ROUND", False)


def _close(actual, expected):
    # float32 sums in another order (and int4's s * sum(x q) + m * sum(x) cancelling): errors scale
    # with the largest output, not with each element
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * np.nanmax(np.abs(expected)))


def _arena(rng, layout, num_slots=3):
    blobs = np.zeros((num_slots, layout.blob_bytes), np.uint8)
    d, i = layout.hidden, layout.inter
    for blob in blobs:  # unequal scales per block and group: a wrong scale index shows
        ramp = np.linspace(0.2, 1.5, d, dtype=np.float32)
        layout.quantize(rng.standard_normal((i, d), dtype=np.float32) * ramp,
                        rng.standard_normal((i, d), dtype=np.float32) * ramp[::-1],
                        rng.standard_normal((d, i), dtype=np.float32) * 0.3, out=blob)
    return blobs


def _run(x, pairs, arena, layout, out, store=None):
    token, slot, pair = (np.ascontiguousarray(c, dtype=np.int32) for c in np.array(pairs).T)
    expert_ffn_quant_cuda(device(x), device(token), device(slot), device(pair), arena, layout, out,
                          poisoned((len(pairs), layout.inter)), store=store)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_expert_ffn_matches_ref_with_runs_and_host_store_misses(rng, fmt):
    layout = ExpertLayout(fmt, 32, 16)
    x = rng.standard_normal((2, 32), dtype=np.float32)
    arena, store = _arena(rng, layout), _arena(rng, layout, 2)
    # slot 1 serves both tokens (a run of two pairs); -2 reads host-store row 1 (a miss, zero copy)
    pairs = [(0, 1, 0), (1, 1, 2), (0, 2, 1), (1, -2, 3)]
    out, expected = poisoned((4, 32)), np.full((4, 32), np.nan, np.float32)
    _run(x, pairs, device(arena), layout, out, store=device(store))
    expert_ffn_quant_ref(x, *np.array(pairs, np.int32).T, arena, layout, expected, store=store)
    _close(out.copy_to_host(), expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hidden", [144, 1040])
def test_quant_expert_ffn_partial_edge_blocks_and_groups(rng, fmt, hidden, monkeypatch):
    from moebus.cuda.kernels import moe_quant

    monkeypatch.setattr(moe_quant, "DOWN_ROWS_SHORT", {fmt: 3})  # 1040 down rows: the last group of 3 is partial
    # D = 144: two blocks / groups along the input, the second 16 wide; D = 1040: nine, and rows of
    # 130 (fp8) or 65 (int4) words, more than a warp's unrolled loads, so lanes loop; I = 16
    layout = ExpertLayout(fmt, hidden, 16)
    x = rng.standard_normal((1, hidden), dtype=np.float32)
    arena = _arena(rng, layout, 1)
    out, expected = poisoned((1, hidden)), np.zeros((1, hidden), np.float32)
    _run(x, [(0, 0, 0)], device(arena), layout, out)
    expert_ffn_quant_ref(x, [0], [0], [0], arena, layout, expected)
    _close(out.copy_to_host(), expected)


def test_quant_expert_ffn_in_several_launches_keeps_runs_whole(rng, monkeypatch):
    monkeypatch.setattr(moe_ffn, "MAX_GRID_Y", 3)
    from moebus.cuda.kernels import moe_quant

    monkeypatch.setattr(moe_quant, "MAX_GRID_Y", 3)  # chunk 2: launches of 2 pairs
    layout = ExpertLayout("int4", 32, 16)
    x = rng.standard_normal((2, 32), dtype=np.float32)
    arena = _arena(rng, layout)
    pairs = [(0, 0, 0), (1, 0, 2), (0, 1, 1), (1, 2, 3)]
    out, expected = poisoned((4, 32)), np.zeros((4, 32), np.float32)
    _run(x, pairs, device(arena), layout, out)
    expert_ffn_quant_ref(x, *np.array(pairs, np.int32).T, arena, layout, expected)
    _close(out.copy_to_host(), expected)


def test_quant_kernel_wrapper_refuses_a_bf16_arena(rng):
    layout = ExpertLayout("fp8", 32, 16)
    with pytest.raises(TypeError, match="arena"):
        _run(np.zeros((1, 32), np.float32), [(0, 0, 0)], device(np.zeros((1, layout.blob_bytes // 2), np.uint16)),
             layout, poisoned((1, 32)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_weights_bf16_is_the_dequantized_blob_rounded(rng, fmt):
    layout = ExpertLayout(fmt, 32, 16)
    arena = _arena(rng, layout, 2)
    bf16 = expert_weights_bf16(layout, arena)
    gate, up, down = layout.dequantize(arena[1])
    n = gate.size
    np.testing.assert_allclose(bf16_to_f32(bf16[1, :n]).reshape(gate.shape), gate, rtol=2**-8)
    np.testing.assert_allclose(bf16_to_f32(bf16[1, 2 * n:]).reshape(down.shape), down, rtol=2**-8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_weights_bf16_on_the_device_matches_the_numpy_hook(rng, fmt):
    layout = ExpertLayout(fmt, 144, 16)  # a partial second block / group along D
    arena = _arena(rng, layout, 3)
    slots = np.array([2, 0], np.int32)
    out = device(np.full((2, 3 * 144 * 16), 0x7FC1, np.uint16))  # bf16 NaN where nothing was written
    expert_weights_bf16_cuda(layout, device(arena), device(slots), out)
    got, expected = bf16_to_f32(out.copy_to_host()), bf16_to_f32(expert_weights_bf16(layout, arena[slots]))
    # int4's q * s + m may be one fused multiply-add on a GPU: at most one bf16 step apart there
    np.testing.assert_allclose(got, expected, rtol=2**-7 if fmt == "int4" else 0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_expert_ffn_long_runs_and_odd_row_groups(rng, fmt, monkeypatch):
    # 8 tokens: chunk 8 (the long-run unroll), a run of 8 pairs and two of 4; rows of 18 (fp8) / 9
    # (int4) words; 3 down rows and 3 gate|up row pairs a warp: the last groups of 144 and 16 are partial
    from moebus.cuda.kernels import moe_quant

    monkeypatch.setattr(moe_quant, "DOWN_ROWS_LONG", 3)
    monkeypatch.setattr(moe_quant, "GATE_UP_ROWS_LONG", 3)
    layout = ExpertLayout(fmt, 144, 16)
    x = rng.standard_normal((8, 144), dtype=np.float32)
    arena = _arena(rng, layout, 3)
    token_slot = [(t, 0) for t in range(8)] + [(t, 1) for t in range(4)] + [(t, 2) for t in range(4, 8)]
    pairs = [(t, s, n) for n, (t, s) in enumerate(token_slot)]  # sorted by slot, as the stage sorts them
    out, expected = poisoned((len(pairs), 144)), np.zeros((len(pairs), 144), np.float32)
    _run(x, pairs, device(arena), layout, out)
    expert_ffn_quant_ref(x, *np.array(pairs, np.int32).T, arena, layout, expected)
    _close(out.copy_to_host(), expected)


def _decode_kernel(decode, per_word):
    @cuda.jit
    def decode_words(words, scales, minima, out):
        i = cuda.grid(1)
        if i < words.shape[0]:
            buf = cuda.local.array((4, 4), float32)
            factor = decode(words[i], scales[i], minima[i], buf)
            for c in range(per_word):
                out[i, c] = buf[c // 4, c % 4] * factor

    return decode_words


@pytest.mark.parametrize("hardware", [False, True])
def test_fp8_words_decode_every_e4m3_code_exactly(hardware):
    from moebus.common.quant import E4M3_VALUES
    from moebus.cuda.kernels.quant_words import can_convert_e4m3, decoder

    if hardware and not can_convert_e4m3():
        pytest.skip("cvt.rn.f16x2.e4m3x2 needs a GPU of compute capability 8.9 or later")
    codes = np.arange(256, dtype=np.uint8)  # 32 words of 8 codes, subnormals and both signs included
    scales = np.full(32, 0.5, np.float32)
    out = poisoned((32, 8))
    _decode_kernel(decoder("fp8", hardware), 8)[1, 32](device(codes.view(np.uint64)), device(scales),
                                                      device(np.zeros(32, np.float32)), out)
    got, expected = out.copy_to_host().reshape(-1), E4M3_VALUES * np.float32(0.5)
    real = ~np.isnan(expected)  # 0x7F / 0xFF: NaN, never written (the encoder saturates at 448)
    np.testing.assert_array_equal(got[real], expected[real])


def test_int4_words_decode_as_scale_times_code_plus_minimum(rng):
    from moebus.cuda.kernels.quant_words import decoder

    nibbles = rng.integers(0, 16, (8, 16)).astype(np.uint64)
    words = (nibbles << (4 * np.arange(16, dtype=np.uint64))).sum(axis=1, dtype=np.uint64)
    scales = rng.uniform(0.01, 0.2, 8).astype(np.float32)
    minima = rng.uniform(-2, 1, 8).astype(np.float32)
    out = poisoned((8, 16))
    _decode_kernel(decoder("int4"), 16)[1, 8](device(words), device(scales), device(minima), out)
    expected = nibbles.astype(np.float32) * scales[:, None] + minima[:, None]
    np.testing.assert_allclose(out.copy_to_host(), expected, rtol=1e-6, atol=1e-6 * np.abs(minima).max())


def test_fp8_runs_of_several_tokens_take_the_conversion_instruction_where_the_gpu_has_it(monkeypatch):
    from moebus.cuda.kernels import quant_words

    # one token: bit moves (measured faster there); runs of 3+: the instruction (fewer instructions)
    monkeypatch.setattr(quant_words, "can_convert_e4m3", lambda: True)
    assert [quant_words.hardware_e4m3(chunk) for chunk in (1, 2, 3, 8)] == [False, False, True, True]
    monkeypatch.setattr(quant_words, "can_convert_e4m3", lambda: False)
    assert not quant_words.hardware_e4m3(8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_expert_ffn_gives_the_same_bits_whatever_the_rows_a_warp(rng, fmt, monkeypatch):
    # a lane sums its words in the same order whatever rows its warp takes (and however many words of
    # each row a round): the work shapes the decode sweep chooses between change no result
    from moebus.cuda.kernels import moe_quant

    layout = ExpertLayout(fmt, 144, 16)  # 144: a partial second block / group; 3 and 5 rows: partial groups
    x = rng.standard_normal((1, 144), dtype=np.float32)
    arena = device(_arena(rng, layout, 2))
    pairs = [(0, 1, 0), (0, 0, 1)]
    results = []
    for gate_rows, words, down_rows in ((1, 8, 1), (3, 2, 5)):
        monkeypatch.setattr(moe_quant, "GATE_UP_SHORT", {fmt: (gate_rows, words)})
        monkeypatch.setattr(moe_quant, "DOWN_ROWS_SHORT", {fmt: down_rows})
        out = poisoned((2, 144))
        _run(x, pairs, arena, layout, out)
        results.append(out.copy_to_host())
    np.testing.assert_array_equal(results[1], results[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_expert_ffn_evict_first_loads_give_the_same_bits(rng, fmt, monkeypatch):
    # STREAM_WEIGHTS: a round's words by one asm statement of ld.global.cs (rows of whole rounds: 512
    # wide, 64 fp8 / 32 int4 words) or one load each (down rows of 16): the same words, the same sums
    from moebus.cuda.kernels import moe_quant

    layout = ExpertLayout(fmt, 512, 16)
    x = rng.standard_normal((1, 512), dtype=np.float32)
    blobs = _arena(rng, layout, 1)
    arena = device(blobs)
    results = []
    for streaming in (False, True):
        monkeypatch.setattr(moe_quant, "STREAM_WEIGHTS", streaming)
        out = poisoned((1, 512))
        _run(x, [(0, 0, 0)], arena, layout, out)
        results.append(out.copy_to_host())
    np.testing.assert_array_equal(results[1], results[0])
    expected = np.zeros((1, 512), np.float32)
    expert_ffn_quant_ref(x, [0], [0], [0], blobs, layout, expected)
    _close(results[1], expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hidden", [144, 512])  # rows of partial rounds (and a partial block / group); whole rounds
def test_quant_expert_ffn_round_gate_gives_the_same_bits(rng, fmt, hidden, monkeypatch):
    # ROUND_GATE starts a round's sums from a +0.0 made of its words' bits (and ROUND_GATE_X of its x
    # words' too) and decodes each word where it is used: at one token (runs of 1) the same sums in the
    # same order as without, hence the same bits, also for a pair whose expert is read from the host store
    from moebus.cuda.kernels import moe_quant

    layout = ExpertLayout(fmt, hidden, 32)
    x = rng.standard_normal((1, hidden), dtype=np.float32)
    blobs = _arena(rng, layout, 2)
    arena, store = device(blobs[:1]), device(blobs[1:])
    pairs = [(0, 0, 0), (0, -1, 1)]  # slot -1: the host store's row 0
    results = []
    for gate, gate_x in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(moe_quant, "ROUND_GATE", gate)
        monkeypatch.setattr(moe_quant, "ROUND_GATE_X", gate_x)
        out = poisoned((2, hidden))
        _run(x, pairs, arena, layout, out, store=store)
        results.append(out.copy_to_host())
    np.testing.assert_array_equal(results[1], results[0])
    np.testing.assert_array_equal(results[2], results[0])
    expected = np.zeros((2, hidden), np.float32)
    expert_ffn_quant_ref(x, [0, 0], [0, -1], [0, 1], blobs[:1], layout, expected, store=blobs[1:])
    _close(results[1], expected)
