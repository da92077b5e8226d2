"""Weights asked into L2 on a side branch of a decode step (loads.l2_warm_cuda, workers/l2_warm.py):
the simulator has no L2, so what is checked is what must hold on a GPU too: the kernel touches
nothing, covers the array in its chunks, refuses what it cannot read, and a decode step with the
branches forked gives the same tokens and logprobs as without."""
import numpy as np
import pytest

from moebus.cuda.kernels import loads
from moebus.cuda.kernels.loads import L2_CHUNK_BYTES, l2_chunks, l2_warm_cuda, l2_warm_slots_cuda
from moebus.workers.local import LocalModel
from tests.cuda.conftest import device
from tests.cuda.test_e2e import MICRO

FUSED = dict(MICRO, head_dim=64)  # heads the fused qkv kernel takes (fused.can_fuse_heads)


@pytest.fixture(scope="module")
def fused_model(tmp_path_factory):
    from moebus.common import tiny_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tiny_model.PRESETS, "micro_fused", FUSED)
        patch.setitem(tiny_model.PRESET_SHARDED, "micro_fused", False)
        return tiny_model.init_model(tmp_path_factory.mktemp("micro_fused"), "qwen3_moe", "micro_fused")


def test_l2_warm_covers_the_array_in_chunks_and_changes_nothing(rng):
    weight = (rng.standard_normal((5, L2_CHUNK_BYTES // 2 // 4 + 3), dtype=np.float32).view(np.uint32) >> 16) \
        .astype(np.uint16)  # bf16 bits, 5 rows a little over a quarter chunk: 2 chunks, the last short
    on_device = device(weight)
    assert l2_chunks(weight) == 2 and l2_warm_cuda(on_device) == 2
    np.testing.assert_array_equal(on_device.copy_to_host(), weight)
    assert l2_warm_cuda(device(np.zeros((0, 8), np.uint16))) == 0


def test_l2_warm_of_arena_slots_changes_nothing_and_checks_its_range(rng):
    arena = rng.integers(0, 1 << 16, (3, L2_CHUNK_BYTES // 2 + 64), dtype=np.uint16)  # a slot: a chunk + 128 bytes
    on_device = device(arena)
    pair_slot = device(np.array([2, 2, -1, 0], np.int32))  # a run on slot 2, one pair read from the host store
    assert l2_warm_slots_cuda(on_device, pair_slot, 0, arena.shape[1] * 2) == 2
    assert l2_warm_slots_cuda(on_device, pair_slot, 1024, 256) == 1
    np.testing.assert_array_equal(on_device.copy_to_host(), arena)
    with pytest.raises(ValueError, match="outside an arena slot"):
        l2_warm_slots_cuda(on_device, pair_slot, 1024, arena.shape[1] * 2)
    with pytest.raises(ValueError, match="16-byte"):
        l2_warm_slots_cuda(on_device, pair_slot, 8, 256)


def test_l2_warm_refuses_a_strided_array(rng):
    with pytest.raises(ValueError, match="contiguous"):
        l2_warm_cuda(device(np.zeros((4, 8), np.float32))[:, 1:5])


def _decode(model, steps: int = 3):
    from moebus.workers.batch import StepBatch

    prompt = [5, 17, 42, 9]
    model.step(StepBatch(slots=[0], starts=[0], lengths=[len(prompt)], tokens=prompt))
    last, tokens, logprobs = [prompt[-1]], [], []
    for i in range(steps):
        out = model.step(StepBatch(slots=[0], starts=[len(prompt) + i], lengths=[1], tokens=last))
        last = [int(t) for t in out.tokens]
        tokens.append(last)
        logprobs.append(out.logprobs.copy())
    return np.array(tokens), np.array(logprobs)


@pytest.mark.parametrize("switches", [dict(WARM_O_PROJ=True, WARM_NEXT_QKV=True),
                                      dict(WARM_O_PROJ=True, WARM_EXPERTS="down"), dict(WARM_EXPERTS="all")])
def test_decode_with_weights_warmed_on_the_side_gives_the_same_tokens_and_logprobs(fused_model, monkeypatch,
                                                                                   switches):
    without = _decode(LocalModel(fused_model, device="cuda", max_context=32))
    for name, value in switches.items():
        monkeypatch.setattr(loads, name, value)
    model = LocalModel(fused_model, device="cuda", max_context=32)
    warmed = _decode(model)
    stage = model.stages[0]
    assert stage.fuse_qkv and stage.warm.side is not None and not stage.warm.open  # forked, then joined
    assert stage.warm.side.forks == 0
    np.testing.assert_array_equal(warmed[0], without[0])
    np.testing.assert_array_equal(warmed[1], without[1])
