"""The wire codec: ``[type][msgpack header][raw frames...]``. Decoding is defensive: explicit size
limits on every frame and msgpack container, a known type, a validated header, tensor frames whose
byte size matches the declared dtype and shape (checked with Python integers, so no declared shape
can overflow). Anything else raises WireError, and only WireError; the loop that received it
answers ERROR (or drops and counts) and goes on."""
from __future__ import annotations

import math

import msgpack
import numpy as np
from pydantic import ValidationError

from moebus.common.protocol import MAX_ID_CHARS, MESSAGES, Message

TENSOR_DTYPES = {"float32", "int32", "uint8", "uint16", "float16", "int64"}
DTYPES = {name: np.dtype(name) for name in TENSOR_DTYPES}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # np.dtype.name costs ~2 us a call
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_TENSOR_FRAMES = 16
MAX_TENSOR_DIMS = 4
MAX_TENSOR_BYTES = 1 << 31  # beyond any one frame that transport.MAX_MESSAGE_BYTES lets through
TENSORS_KEY = "_tensors"


class WireError(ValueError):
    """A message that cannot be decoded; ``msg_type`` is set when the type frame was readable and
    ``request_id`` when the header named one (so the error can reach the waiting request)."""

    def __init__(self, message: str, msg_type: bytes | None = None, request_id: str | None = None):
        super().__init__(message)
        self.msg_type = msg_type
        self.request_id = request_id


class CodecBug(WireError):
    """What decode raises when a message met an exception that no check of the codec named (a bug
    to fix, e.g. a case a check missed). Receivers treat it as any WireError; the fuzzers
    (tests/common/test_wire_fuzz.py, tools/fuzz_wire.py) count it as a finding."""


def _add_frame(frames: list, array: np.ndarray) -> list:
    array = np.ascontiguousarray(array)
    frames.append(memoryview(array).cast("B") if array.size else b"")
    return [len(frames) - 1, DTYPE_NAMES.get(array.dtype) or array.dtype.name, list(array.shape)]


def encode(message: Message) -> list[bytes | memoryview]:
    header = message.model_dump(exclude=set(message.TENSORS) | set(message.TENSOR_LISTS), exclude_none=True)
    frames: list = []
    tensors = {}
    for name in message.TENSORS:
        array = getattr(message, name)
        if array is not None:
            tensors[name] = _add_frame(frames, array)
    for name in message.TENSOR_LISTS:  # a list of tensors: one spec and one frame each
        arrays = getattr(message, name)
        if arrays is not None:
            tensors[name] = [_add_frame(frames, a) for a in arrays]
    if tensors:
        header[TENSORS_KEY] = tensors
    return [message.TYPE, msgpack.packb(header, use_bin_type=True)] + frames


def _unpack_header(raw: bytes) -> dict:
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                                 max_str_len=MAX_HEADER_BYTES, max_bin_len=0, max_array_len=1 << 20,
                                 max_map_len=1 << 16, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"header is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise WireError("header must be a msgpack map")
    return header


def _tensor(frames: list, spec) -> np.ndarray:
    if not (isinstance(spec, list) and len(spec) == 3):
        raise WireError("tensor spec must be [frame, dtype, shape]")
    index, dtype, shape = spec
    if not (type(index) is int and 0 <= index < len(frames)):
        raise WireError(f"tensor frame {str(index)[:32]} does not exist")
    if not (isinstance(dtype, str) and dtype in TENSOR_DTYPES):
        raise WireError(f"tensor dtype {str(dtype)[:32]!r} is not allowed")
    if not (isinstance(shape, list) and len(shape) <= MAX_TENSOR_DIMS
            and all(type(n) is int and 0 <= n <= MAX_TENSOR_BYTES for n in shape)):
        raise WireError(f"bad tensor shape {str(shape)[:64]}")
    frame = memoryview(frames[index]).cast("B")
    dtype = DTYPES[dtype]
    num_bytes = math.prod(shape) * dtype.itemsize  # Python integers: a huge declared shape cannot wrap
    if num_bytes > MAX_TENSOR_BYTES or num_bytes != frame.nbytes:
        raise WireError(f"tensor frame of {frame.nbytes} bytes does not hold {dtype.name}{shape}")
    return np.frombuffer(frame, dtype=dtype).reshape(shape)


def decode(frames: list) -> Message:
    """A validated message from raw frames (bytes or zmq.Frame buffers). Raises only WireError."""
    try:
        return _decode(frames)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - a codec bug met by one message must not end the loop
        raise CodecBug(f"undecodable message: {type(e).__name__}: {str(e)[:200]}") from None


def _decode(frames: list) -> Message:
    if len(frames) < 2:
        raise WireError(f"expected at least 2 frames, got {len(frames)}")
    msg_type = bytes(frames[0])
    cls = MESSAGES.get(msg_type)
    if cls is None:  # e.g. a newer peer's: the request its header names can still be told
        raise WireError(f"unknown message type {msg_type[:32]!r}", request_id=_readable_id(frames[1]))
    raw_tensors = [memoryview(f) for f in frames[2:]]
    header = _unpack_header(bytes(frames[1]))
    try:
        if len(raw_tensors) > MAX_TENSOR_FRAMES:  # checked after the header so the error names the request
            raise WireError(f"{len(raw_tensors)} tensor frames exceed {MAX_TENSOR_FRAMES}", msg_type)
        return _validate(cls, msg_type, header, raw_tensors)
    except WireError as e:
        request_id = header.get("id")
        e.request_id = request_id if isinstance(request_id, str) and len(request_id) <= MAX_ID_CHARS else None
        raise


def _readable_id(raw) -> str | None:
    """The request id of a header that is a readable map, else None."""
    try:
        request_id = _unpack_header(bytes(raw)).get("id")
    except WireError:
        return None
    return request_id if isinstance(request_id, str) and len(request_id) <= MAX_ID_CHARS else None


def _validate(cls, msg_type: bytes, header: dict, raw_tensors: list) -> Message:
    specs = header.pop(TENSORS_KEY, {})
    if not isinstance(specs, dict) or not set(specs) <= set(cls.TENSORS) | set(cls.TENSOR_LISTS):
        raise WireError(f"{msg_type.decode()}: unexpected tensors {sorted(specs) if isinstance(specs, dict) else specs}",
                        msg_type)
    used = []
    for name, spec in specs.items():
        if name in cls.TENSOR_LISTS:
            if not isinstance(spec, list) or len(spec) > MAX_TENSOR_FRAMES:
                raise WireError(f"{msg_type.decode()}: {name} must be a list of tensor specs", msg_type)
            header[name] = [_tensor(raw_tensors, s) for s in spec]
            used += [s[0] for s in spec]
        else:
            header[name] = _tensor(raw_tensors, spec)
            used.append(spec[0])
    if sorted(used) != list(range(len(raw_tensors))):  # every frame named exactly once
        raise WireError(f"{msg_type.decode()}: {len(raw_tensors)} tensor frames for {len(used)} tensors", msg_type)
    try:
        return cls.model_validate(header)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])[:200]
        raise WireError(f"{msg_type.decode()}: {where}: {first['msg'][:300]}", msg_type) from None
