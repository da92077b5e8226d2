"""What every message that ``wire.decode`` lets through must satisfy, checked by both fuzzers
(hypothesis in test_wire_fuzz.py, atheris in tools/fuzz_wire.py): it encodes and decodes again to
the same frames, and every number of a typed field fits an int64 (integers) or is finite (floats),
so no receiver can overflow an array or compare with NaN. Free-form fields (``dict[str, Any]``:
chat messages, tools, stats) are JSON-like data for templates and reports, not numbers anyone puts
in an array, and are left out."""
from __future__ import annotations

import math

from pydantic import BaseModel

from moebus.common import wire
from moebus.common.protocol import Message

MIN_INT64, MAX_INT64 = -(2 ** 63), 2 ** 63 - 1


def check_decoded(message: Message) -> None:
    assert isinstance(message, Message), type(message)
    frames = [bytes(f) for f in wire.encode(message)]
    again = [bytes(f) for f in wire.encode(wire.decode(frames))]
    assert again == frames, f"{type(message).__name__} does not survive a second round trip"
    check_numbers(message, type(message).__name__)


def check_numbers(model: BaseModel, where: str) -> None:
    skipped = set(getattr(model, "TENSORS", ())) | set(getattr(model, "TENSOR_LISTS", ()))
    for name, field in type(model).model_fields.items():
        if name not in skipped and "Any" not in str(field.annotation):
            _check_value(getattr(model, name), f"{where}.{name}")


def _check_value(value, where: str) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        assert MIN_INT64 <= value <= MAX_INT64, f"{where} = {value} does not fit an int64"
    elif isinstance(value, float):
        assert math.isfinite(value), f"{where} = {value} is not finite"
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_value(item, f"{where}[{i}]")
    elif isinstance(value, BaseModel):
        check_numbers(value, where)
