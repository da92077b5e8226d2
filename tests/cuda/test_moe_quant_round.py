"""The one-round expert GEMVs for batch 1 (moe_quant_round.py, moe_quant.FP8_ONE_ROUND / INT4_ONE_ROUND)
against the numpy reference, and against moe_quant.py's kernels."""
import numpy as np
import pytest

from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.kernels import moe_quant, moe_quant_round
from moebus.cuda.kernels.moe_quant import expert_ffn_quant_ref
from tests.cuda.conftest import device, poisoned
from tests.cuda.test_moe_quant import _arena, _close, _run
from tests.cuda.test_quant_e2e import micro_fp8_model  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.usefixtures("exact_quant_kernels")  # the numba one-round kernels


@pytest.mark.parametrize("hidden, inter, gate_rows, down_rows, hardware", [
    (256, 128, 2, 8, True),  # rows of whole rounds: 16 / 8 words, 1 / 2 a lane
    (256, 128, 1, 4, False),  # e4m3 by bit moves (their rows a warp; on a GPU: the simulator always uses them)
    (144, 48, 1, 4, True),   # partial scale blocks along D (128 + 16); words past a row's end (9 words, 32 lanes)
    (1040, 32, 2, 8, True),  # 65 words a gate|up row (5 a lane, the last clamped); 1040 down rows: a partial group
])
def test_quant_one_round_matches_ref_with_a_host_store_miss(rng, monkeypatch, hidden, inter, gate_rows, down_rows,
                                                          hardware):
    monkeypatch.setattr(moe_quant, "FP8_ONE_ROUND", True)
    monkeypatch.setattr(moe_quant_round, "GATE_UP_ROWS", gate_rows)
    monkeypatch.setattr(moe_quant_round, "DOWN_ROWS", down_rows)
    monkeypatch.setattr(moe_quant_round, "GATE_UP_HARDWARE", hardware)
    monkeypatch.setattr(moe_quant_round, "DOWN_HARDWARE", hardware)
    if hardware:  # the simulator then runs the bit moves with the instruction's work shapes
        monkeypatch.setattr(moe_quant, "round_hardware", lambda: True)
    layout = ExpertLayout("fp8", hidden, inter)
    x = rng.standard_normal((1, hidden), dtype=np.float32)
    arena, store = _arena(rng, layout), _arena(rng, layout, 2)
    assert moe_quant.one_round(layout, 1, device(arena), device(store))
    pairs = [(0, 2, 1), (0, -2, 0), (0, 0, 2)]  # one token's experts: slot 2, host-store row 1, slot 0
    out, expected = poisoned((3, hidden)), np.full((3, hidden), np.nan, np.float32)
    _run(x, pairs, device(arena), layout, out, store=device(store))
    expert_ffn_quant_ref(x, *np.array(pairs, np.int32).T, arena, layout, expected, store=store)
    _close(out.copy_to_host(), expected)


def test_quant_one_round_serves_batch_1_only(rng, monkeypatch):
    monkeypatch.setattr(moe_quant, "FP8_ONE_ROUND", True)
    layout = ExpertLayout("fp8", 256, 128)
    arena = device(_arena(rng, layout, 1))
    assert moe_quant.one_round(layout, 1, arena, arena)
    assert not moe_quant.one_round(layout, 2, arena, arena)  # runs of 2 pairs: moe_quant.py's kernels
    monkeypatch.setattr(moe_quant, "INT4_ONE_ROUND", False)
    assert not moe_quant.one_round(ExpertLayout("int4", 256, 128), 1, arena, arena)  # INT4_ONE_ROUND off
    monkeypatch.setattr(moe_quant, "FP8_ONE_ROUND", False)
    assert not moe_quant.one_round(layout, 1, arena, arena)


def test_quant_one_round_and_the_eight_byte_kernels_agree(rng, monkeypatch):
    layout = ExpertLayout("fp8", 256, 128)
    x = rng.standard_normal((1, 256), dtype=np.float32)
    arena = device(_arena(rng, layout, 2))
    pairs = [(0, 1, 0), (0, 0, 1)]
    results = []
    for on in (False, True):
        monkeypatch.setattr(moe_quant, "FP8_ONE_ROUND", on)
        out = poisoned((2, 256))
        _run(x, pairs, arena, layout, out)
        results.append(out.copy_to_host())
    _close(results[1], results[0])


def test_quant_one_round_experts_and_projections_match_the_cpu_device(micro_fp8_model, monkeypatch):  # noqa: F811
    # fp8 experts (half resident: misses read the host store) and fp8 q/k/v/o, decode through the
    # one-round kernels; the prefill's runs of several tokens through moe_quant.py's
    from moebus.cuda.kernels import linear_quant
    from moebus.workers.local import LocalModel

    monkeypatch.setattr(moe_quant, "FP8_ONE_ROUND", True)
    monkeypatch.setattr(linear_quant, "ONE_ROUND", True)
    prompt = [5, 17, 42, 9, 77]
    runs = {device: LocalModel(micro_fp8_model, device=device, max_context=32, cache_fraction=0.5, experts_dtype="fp8",
                               attention_dtype="fp8").generate(prompt, 3) for device in ("cpu", "cuda")}
    assert runs["cuda"].tokens == runs["cpu"].tokens
    np.testing.assert_allclose(runs["cuda"].logprobs, runs["cpu"].logprobs, atol=1e-4)


def test_quant_one_round_fits_a3b_and_leaves_wider_rows_to_the_old_kernels():
    assert moe_quant_round.fits(2048, 2, 2) and moe_quant_round.fits(768, 8, 1)  # 16 and 12 words a lane
    gate_rows, _, down_rows, _ = moe_quant_round.shape("fp8", hardware=False)
    assert (gate_rows, down_rows) == (moe_quant_round.GATE_UP_ROWS_BIT_MOVES, moe_quant_round.DOWN_ROWS_BIT_MOVES)
    assert not moe_quant_round.fits(4096, 2, 2)  # 32 words a lane
    assert not moe_quant_round.fits(2056, 2, 2)  # not whole 16-byte words
    assert moe_quant_round.fits(2048, 1, 2, "int4") and moe_quant_round.fits(768, 8, 1, "int4")  # 4 and 6 words a lane
    assert not moe_quant_round.fits(784, 8, 1, "int4")  # 784 int4 codes: not whole 16-byte words


@pytest.mark.parametrize("hidden, inter, gate_rows, down_rows", [
    (256, 128, 4, 8),   # int4 rows of whole rounds: 8 / 4 words (32 codes each), 1 a lane
    (160, 64, 4, 8),    # a partial group along D (128 + 32); 5 and 2 words a row, lanes past a row's end
    (1056, 32, 2, 16),  # 33 words a gate|up row (3 a lane, the last clamped); 1056 down rows: a partial group
])
def test_int4_one_round_matches_ref_with_a_host_store_miss(rng, monkeypatch, hidden, inter, gate_rows, down_rows):
    monkeypatch.setattr(moe_quant, "INT4_ONE_ROUND", True)
    monkeypatch.setattr(moe_quant_round, "INT4_GATE_UP_ROWS", gate_rows)
    monkeypatch.setattr(moe_quant_round, "INT4_DOWN_ROWS", down_rows)
    monkeypatch.setattr(moe_quant_round, "_down_early", True)  # the wait moves (a no-op here)
    layout = ExpertLayout("int4", hidden, inter)
    x = rng.standard_normal((1, hidden), dtype=np.float32)
    arena, store = _arena(rng, layout), _arena(rng, layout, 2)
    assert moe_quant.one_round(layout, 1, device(arena), device(store))
    pairs = [(0, 2, 1), (0, -2, 0), (0, 0, 2)]
    out, expected = poisoned((3, hidden)), np.full((3, hidden), np.nan, np.float32)
    _run(x, pairs, device(arena), layout, out, store=device(store))
    expert_ffn_quant_ref(x, *np.array(pairs, np.int32).T, arena, layout, expected, store=store)
    _close(out.copy_to_host(), expected)


def test_the_one_round_expert_kernel_waits_first():
    # test_pdl.py's rule for the decode step's kernels (this file's kernel is a bounded_kernel, which
    # that test does not pick up): the PDL wait is the kernel body's first statement
    import ast
    from pathlib import Path

    from tests.cuda.test_pdl import _is_wait

    tree = ast.parse(Path(moe_quant_round.__file__).read_text())
    kernels = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
               and any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "bounded_kernel"
                       for d in node.decorator_list)]
    assert [k.name for k in kernels] == ["quant_one_round"]
    first = kernels[0].body[0]  # `if not early: grid_dependency_wait()` (DOWN_LOAD_BEFORE_WAIT: early)
    assert isinstance(first, ast.If) and ast.unparse(first.test) == "not early" and _is_wait(first.body[0])
