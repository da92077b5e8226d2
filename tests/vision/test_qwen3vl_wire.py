"""The Qwen3-VL fields of STEP and ENCODE_REPLY: round trips, and arrays that disagree refused."""
import numpy as np
import pytest

from moebus.common import protocol as p
from moebus.common import wire


def _step(**fields):
    return p.Step(step_id=7, slots=np.zeros(1, np.int32), starts=np.zeros(1, np.int32), lengths=np.full(1, 3, np.int32),
                  tokens=np.arange(3, dtype=np.int32), **fields)


SAMPLES = [
    _step(rope_positions=np.array([[0, 0, 0], [1, 1, 2], [3, 3, 3]], np.int32),
          deepstack=np.ones((2, 1, 8), np.float32), deepstack_rows=np.array([1], np.int32)),
    p.EncodeReply(encode_id=2, generation="v", embeds=np.ones((4, 8), np.float32), deepstack=np.ones((3, 4, 8), np.float32)),
    # the vision worker's: embeddings and DeepStack features stacked in one (1 + L, rows, D) array
    p.EncodeReply(encode_id=3, generation="v", embeds=np.arange(4 * 4 * 8, dtype=np.float32).reshape(4, 4, 8)),
]


@pytest.mark.parametrize("message", SAMPLES, ids=["step", "encode_reply", "encode_reply_stacked"])
def test_round_trip(message):
    back = wire.decode([bytes(f) for f in wire.encode(message)])
    for name in ("rope_positions", "deepstack", "deepstack_rows", "embeds"):
        if hasattr(message, name) and getattr(message, name) is not None:
            np.testing.assert_array_equal(getattr(back, name), getattr(message, name))


@pytest.mark.parametrize("fields", [
    dict(rope_positions=np.zeros((2, 3), np.int32)),  # not one row per token
    dict(rope_positions=np.full((3, 3), -1, np.int32)),
    dict(rope_positions=np.zeros((3, 3), np.float32)),
    dict(deepstack=np.ones((2, 1, 8), np.float32)),  # without its rows
    dict(deepstack=np.ones((2, 2, 8), np.float32), deepstack_rows=np.array([1], np.int32)),
    dict(deepstack=np.ones((2, 1, 8), np.float32), deepstack_rows=np.array([3], np.int32)),  # past the tokens
])
def test_inconsistent_arrays_are_refused(fields):
    with pytest.raises(ValueError):
        _step(**fields)
