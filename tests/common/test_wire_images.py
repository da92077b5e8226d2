"""Images travel as raw frames, one per image (a tensor list); the codec refuses frames that the
header does not name, frames named twice, and image frames that are not 1-D uint8."""
import msgpack
import numpy as np
import pytest

from moebus.common import protocol as p
from moebus.common import wire


def _image(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)


def test_each_image_is_its_own_raw_frame():
    msg = p.Generate(id="r", messages=[{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                     images=[_image(b"first"), _image(b"second!")])
    frames = wire.encode(msg)
    header = msgpack.unpackb(bytes(frames[1]))
    assert "images" not in {k for k in header if k != "_tensors"}
    specs = header["_tensors"]["images"]
    assert [bytes(frames[2 + s[0]]) for s in specs] == [b"first", b"second!"]
    back = wire.decode([bytes(f) for f in frames])
    assert [bytes(a) for a in back.images] == [b"first", b"second!"]


def test_encode_carries_the_request_and_its_images():
    msg = p.Encode(encode_id=7, request_id="req", images=[_image(b"\x89PNG"), _image(b"\xff\xd8")])
    back = wire.decode([bytes(f) for f in wire.encode(msg)])
    assert (back.encode_id, back.request_id) == (7, "req")
    assert [bytes(a) for a in back.images] == [b"\x89PNG", b"\xff\xd8"]


def test_step_embeddings_round_trip_with_tokens():
    embeds = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    msg = p.Step(step_id=1, slots=np.zeros(1, np.int32), starts=np.zeros(1, np.int32),
                 lengths=np.full(1, 5, np.int32), tokens=np.arange(5, dtype=np.int32), embeds=embeds,
                 embed_rows=np.array([1, 2, 3], np.int32))
    back = wire.decode([bytes(f) for f in wire.encode(msg)])
    assert np.array_equal(back.embeds, embeds) and back.embed_rows.tolist() == [1, 2, 3]


def _raw_generate(tensors: dict, frames: list[bytes]) -> list[bytes]:
    return [b"GENERATE", msgpack.packb({"id": "g1", "prompt": "x", "_tensors": tensors})] + frames


@pytest.mark.parametrize("tensors,frames,match", [
    ({"images": [[0, "uint8", [3]], [0, "uint8", [3]]]}, [b"abc"], "tensor frames for"),  # one frame named twice
    ({"images": [[0, "uint8", [3]]]}, [b"abc", b"def"], "tensor frames for"),  # a frame nobody names
    ({"images": [[0, "float32", [1]]]}, [b"abcd"], "uint8"),
    ({"images": [[0, "uint8", [1, 4]]]}, [b"abcd"], "1-D"),
    ({"images": [0, "uint8", [4]]}, [b"abcd"], "tensor spec"),
    ({"images": "nope"}, [], "list of tensor specs"),
])
def test_bad_image_frames_are_refused_naming_the_request(tensors, frames, match):
    with pytest.raises(wire.WireError, match=match) as info:
        wire.decode(_raw_generate(tensors, frames))
    assert info.value.request_id == "g1"


def test_too_many_frames_still_name_the_request():
    frames = _raw_generate({"images": [[i, "uint8", [1]] for i in range(20)]}, [b"x"] * 20)
    with pytest.raises(wire.WireError, match="exceed") as info:
        wire.decode(frames)
    assert info.value.request_id == "g1"
