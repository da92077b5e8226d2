"""The step pool's buffers come in power-of-two size classes, so on cuda a step of T tokens takes the
scratch of a step of the next power of two: the measured budget counts tokens that way (a 756-token image
step on the H200 allocated 448 MiB beyond a loan sized linearly from the 512-token warm-up, outside the
GPU's budget: twenty-sixth session). The cuda backend under the simulator (its pool is the real one)."""
import numpy as np
import pytest

from moebus.workers.batch import StepBatch
from moebus.workers.cache_sizing import ScratchBudget, measure_scratch, spread_ids, widened
from moebus.workers.local import LocalModel
from tests.cuda.test_e2e import init_micro


def test_pow2_classes_count_a_step_as_the_next_power_of_two_and_pieces_fit_their_loan():
    linear = ScratchBudget.measured(tokens=4, standing_bytes=1000, per_token_bytes=10)
    classes = ScratchBudget.measured(tokens=4, standing_bytes=1000, per_token_bytes=10, pow2_classes=True)
    assert linear.bytes_for(40) == 1000 + 36 * 10 and classes.bytes_for(40) == 1000 + 60 * 10
    assert classes.bytes_for(64) == linear.bytes_for(64) and classes.bytes_for(3) == 1000
    for extra in (0, 5, 35, 600, 601, 5000):
        tokens = classes.tokens_within(extra)
        assert tokens >= 4 and classes.bytes_for(tokens) <= 1000 + extra
    assert classes.tokens_within(600) == 64 and linear.tokens_within(600) == 64
    assert classes.tokens_within(590) == 32 and linear.tokens_within(590) == 63
    wide = widened(classes, spare_bytes=590, max_step_tokens=512)
    assert wide.pow2_classes and wide.tokens == 32 and wide.standing_bytes == classes.bytes_for(32)


def test_the_warm_up_ids_differ_so_its_tokens_route_to_many_experts():
    ids = spread_ids(512, 151_936)
    assert len(np.unique(ids)) == 512 and ids.min() >= 0 and ids.max() < 151_936
    assert len(np.unique(spread_ids(100, 64))) == 64  # a small vocabulary: every id


@pytest.fixture(scope="module")
def micro4(tmp_path_factory):
    return init_micro(tmp_path_factory, "micro4c", num_hidden_layers=4)


@pytest.mark.parametrize("tokens", [40, 48])
def test_a_step_between_powers_of_two_allocates_nothing_beyond_its_loan(micro4, tokens):
    stage = LocalModel(micro4, device="cuda", parts=2, num_slots=2, max_context=128, elastic=True).stages[0]
    stage.scratch = measure_scratch(stage, 2, 32)
    assert stage.scratch.pow2_classes
    pool = stage.ops.device_pool
    stage.forward(StepBatch(slots=[0, 1], starts=[0, 0], lengths=[1, 1], tokens=[5, 17]))
    stage.forward(StepBatch(slots=[0, 1], starts=[0, 0], lengths=[tokens - tokens // 2, tokens // 2],
                            tokens=np.arange(tokens) % 50 + 3))
    assert pool.beyond_loan_bytes == 0  # linear from the 32-token warm-up: 65,536 / 40,960 bytes beyond
