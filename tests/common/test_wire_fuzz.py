"""Property-based fuzz of the codec: whatever the frames, wire.decode returns a valid message or
raises WireError, never anything else; every number of a decoded message fits the numpy dtype the
receiver puts it in. Runs in CI (a few hundred examples per property)."""
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moebus.common import protocol as p
from moebus.common import wire
from tests.common.wire_invariants import check_decoded

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TYPES = sorted(p.MESSAGES)

# msgpack values of every kind, with integers past int64 and floats that are not finite
scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
dims = st.integers(-2, 2 ** 33) | st.sampled_from([0, 1, 2 ** 30, 2 ** 31, 2 ** 32])
specs = st.lists(st.integers(-1, 3) | values, min_size=0, max_size=4) | st.tuples(
    st.integers(-1, 3), st.sampled_from(sorted(wire.TENSOR_DTYPES) + ["object", "float128"]) | values,
    st.lists(dims, max_size=5) | values).map(list)


def field_names(msg_type: bytes) -> list[str]:
    cls = p.MESSAGES[msg_type]
    return sorted(cls.model_fields) + ["id", "sampling", "_bogus"]


@st.composite
def headers(draw):
    msg_type = draw(st.sampled_from(TYPES))
    cls = p.MESSAGES[msg_type]
    header = draw(st.dictionaries(st.sampled_from(field_names(msg_type)), values, max_size=6))
    if cls.TENSORS and draw(st.booleans()):
        header[wire.TENSORS_KEY] = draw(st.dictionaries(st.sampled_from(cls.TENSORS + ("bogus",)), specs, max_size=4))
    frames = draw(st.lists(st.binary(max_size=64), max_size=5))
    return [msg_type, msgpack.packb(header, use_bin_type=True)] + frames


def decode_only_wire_errors(frames):
    """The decoded message, or None for a WireError that a check of the codec raised on purpose; a
    CodecBug (an exception no check named, caught by decode's last resort) fails the test."""
    try:
        return wire.decode(frames)
    except wire.CodecBug:
        raise
    except wire.WireError:
        return None


@FUZZ
@given(st.lists(st.binary(max_size=256), max_size=6))
def test_random_bytes_raise_only_wire_error(frames):
    decode_only_wire_errors(frames)


@FUZZ
@given(st.sampled_from(TYPES), st.binary(max_size=512), st.lists(st.binary(max_size=32), max_size=3))
def test_a_known_type_with_a_random_header_raises_only_wire_error(msg_type, header, tensors):
    decode_only_wire_errors([msg_type, header] + tensors)


@FUZZ
@given(headers())
def test_schema_shaped_headers_decode_or_raise_wire_error(frames):
    message = decode_only_wire_errors(frames)
    if message is not None:  # survives a second trip unchanged; its typed numbers fit int64 / are finite
        check_decoded(message)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(p.Sampling.model_fields)), values, max_size=6),
       st.lists(st.integers(-(2 ** 40), 2 ** 40), max_size=8))
def test_decoded_numbers_fit_the_arrays_of_a_step(sampling, prompt_tokens):
    frames = [b"GENERATE", msgpack.packb({"id": "f", "prompt_tokens": prompt_tokens, "sampling": sampling})]
    message = decode_only_wire_errors(frames)
    if message is None:
        return
    s = message.sampling
    np.array(message.prompt_tokens, np.int32)
    np.array([s.top_k, s.max_tokens or 1, *s.stop_token_ids], np.int32)
    np.array([s.temperature, s.top_p], np.float32)
    assert all(np.isfinite([s.temperature, s.top_p]))


@FUZZ
@given(st.lists(st.integers(-5, 2 ** 32) | st.floats(), max_size=4) | st.floats() | st.integers(-(2 ** 63), 2 ** 64 - 1))
def test_vram_reserves_are_finite_mib_that_fit_int64_bytes(reserve):
    message = decode_only_wire_errors([b"VRAM", msgpack.packb({"reserve_mib": reserve})])
    if message is not None and message.reserve_mib is not None:
        values = message.reserve_mib if isinstance(message.reserve_mib, list) else [message.reserve_mib]
        assert all(0 <= v and int(v * 2 ** 20) < 2 ** 63 for v in values)


# -- the examples of issue 10, each one a crash before the codec checked them -------------------

def test_a_shape_whose_product_wraps_int64_is_refused():
    # 2**30 * 2**30 * 2**4 float32 elements: the int64 product wraps to 0 bytes, matching an empty frame
    frames = [b"STEP", msgpack.packb({"step_id": 1, "_tensors": {"slots": [0, "float32", [2 ** 30, 2 ** 30, 16]]}}),
              b""]
    with pytest.raises(wire.WireError, match="does not hold"):
        wire.decode(frames)


def test_an_unhashable_dtype_is_refused():
    frames = [b"STEP", msgpack.packb({"step_id": 1, "_tensors": {"slots": [0, ["int32"], [1]]}}), b"\0" * 4]
    with pytest.raises(wire.WireError, match="not allowed"):
        wire.decode(frames)


def test_top_k_past_int32_is_refused():
    frames = [b"GENERATE", msgpack.packb({"id": "x", "prompt": "hi", "sampling": {"top_k": 2 ** 31}})]
    with pytest.raises(wire.WireError, match="top_k"):
        wire.decode(frames)


def test_an_integer_past_int64_is_refused():
    frames = [b"GENERATE", msgpack.packb({"id": "x", "prompt_tokens": [2 ** 64 - 1]})]
    with pytest.raises(wire.WireError, match="prompt_tokens"):
        wire.decode(frames)


@pytest.mark.parametrize("tensors,match", [
    ({"slots": np.zeros(2, np.int32), "starts": np.zeros(3, np.int32), "lengths": np.ones(2, np.int32)}, "starts"),
    ({"slots": np.array([-1], np.int32), "starts": np.zeros(1, np.int32), "lengths": np.ones(1, np.int32)}, ">= 0"),
    ({"slots": np.zeros(1, np.int32), "starts": np.zeros(1, np.int32), "lengths": np.ones(1, np.int32),
      "tokens": np.zeros(5, np.int32)}, "tokens"),
    ({"slots": np.zeros(1, np.int32), "starts": np.zeros(1, np.int32), "lengths": np.ones(1, np.int32),
      "hidden": np.zeros((3, 4), np.float32)}, "hidden"),
])
def test_a_step_whose_arrays_disagree_is_refused(tensors, match):
    header, frames = {"step_id": 1, wire.TENSORS_KEY: {}}, []
    for name, array in tensors.items():
        header[wire.TENSORS_KEY][name] = [len(frames), array.dtype.name, list(array.shape)]
        frames.append(array.tobytes())
    with pytest.raises(wire.WireError, match=match):
        wire.decode([b"STEP", msgpack.packb(header)] + frames)


@pytest.mark.parametrize("num_seqs", [1, 3, 200])  # check_step_arrays reduces small steps in Python, large in numpy
@pytest.mark.parametrize("bad,match", [("slots", ">= 0"), ("starts", ">= 0"), ("lengths", ">= 0"),
                                       ("tokens", "token ids"), ("embed_rows", "embed_rows")])
def test_both_ways_of_checking_a_step_refuse_the_same(num_seqs, bad, match):
    arrays = {"slots": np.arange(num_seqs, dtype=np.int32), "starts": np.full(num_seqs, 5, np.int32),
              "lengths": np.ones(num_seqs, np.int32), "tokens": np.full(num_seqs, 7, np.int32),
              "embeds": np.zeros((1, 4), np.float32), "embed_rows": np.array([num_seqs - 1], np.int32)}
    p.Step(step_id=1, **arrays)  # the good step passes
    arrays[bad] = arrays[bad].copy()
    arrays[bad][-1] = {"lengths": 0, "tokens": -3, "embed_rows": num_seqs}.get(bad, -1)
    with pytest.raises(ValueError, match=match):
        p.Step(step_id=1, **arrays)


# -- found by the coverage-guided fuzzer (tools/fuzz_wire.py; inputs in tests/fuzz/regressions/) ---

@pytest.mark.parametrize("msg_type,header,field", [
    (b"ENCODE_REPLY", {"encode_id": 3, "generation": "v", "error": "bad image", "image": 2 ** 63}, "image"),
    (b"ENCODE_REPLY", {"encode_id": 3, "generation": "v", "compute_s": -1.0}, "compute_s"),
    (b"VISION_READY", {"generation": "g", "gpu": 0, "device": "cpu", "pid": 2 ** 64 - 1, "num_image_tokens": 4,
                       "hidden_size": 8}, "pid"),
    (b"VISION_READY", {"generation": "g", "gpu": 0, "device": "cpu", "pid": 9, "num_image_tokens": -5,
                       "hidden_size": 8}, "num_image_tokens"),
    (b"VISION_READY", {"generation": "g", "gpu": 0, "device": "cpu", "pid": 9, "num_image_tokens": 4,
                       "hidden_size": 8, "device_bytes": 2 ** 64 - 1}, "device_bytes"),
    (b"TOKENIZE_REPLY", {"id": "t", "tokens": [2 ** 64 - 1], "max_context": 8}, "tokens"),
    (b"TOKENIZE_REPLY", {"id": "t", "tokens": [1], "max_context": -1}, "max_context"),
])
def test_every_number_of_a_worker_or_broker_reply_is_bounded(msg_type, header, field):
    with pytest.raises(wire.WireError, match=field):
        wire.decode([msg_type, msgpack.packb(header)])
