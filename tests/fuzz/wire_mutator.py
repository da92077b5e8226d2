"""A structure-aware mutator for tools/fuzz_wire.py. libFuzzer's byte mutations rarely keep a
msgpack header parseable *and* change one value in it (turning the fixint 9 of a pid into a
uint64 means inserting 8 bytes and changing one, at the one right offset), so most inputs would
only exercise the msgpack refusal. This mutator unpacks the header, changes one node of it (an
edge number, another type, a field of the message type added or dropped, a list grown or cut),
sometimes renames the type or mutates one tensor frame's bytes, and packs it again; a share of
the inputs still get libFuzzer's own byte mutations, so the byte-level refusals stay covered."""
from __future__ import annotations

import random

import msgpack

from moebus.common import protocol

INTS = [0, 1, -1, 2 ** 31 - 1, 2 ** 31, -(2 ** 31) - 1, 2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, -(2 ** 63)]
FLOATS = [0.0, -0.0, 0.5, float("inf"), float("-inf"), float("nan"), 1e300, 2.0 ** 64, -1e-300]
STRINGS = ["", "x", "\u00e9", "x" * 300, "int32", "float32", "object", "stop", "length", "cancelled"]
FIELDS = sorted({name for cls in (*protocol.MESSAGES.values(), protocol.Sampling) for name in cls.model_fields}
                | {"_tensors"})
TYPES = sorted(protocol.MESSAGES)
BYTE_SHARE = 0.25  # inputs that get libFuzzer's byte mutations instead


def _any_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rng.choice(INTS)
    if kind == 1:
        return rng.choice(FLOATS)
    if kind == 2:
        return rng.choice(STRINGS)
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return rng.randrange(-5, 70)
    if kind == 5:
        return [_any_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELDS): _any_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def _nodes(value, out: list, parent=None, key=None) -> list:
    """(parent, key) of every node, the root as (None, None)."""
    out.append((parent, key))
    if isinstance(value, dict):
        for k in list(value):
            _nodes(value[k], out, value, k)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _nodes(item, out, value, i)
    return out


def mutate_header(header, rng: random.Random):
    parent, key = rng.choice(_nodes(header, []))
    node = header if parent is None else parent[key]
    action = rng.randrange(4)
    if action == 0 and isinstance(node, dict):  # add a field (of some message type) or drop one
        if node and rng.random() < 0.4:
            del node[rng.choice(list(node))]
        else:
            node[rng.choice(FIELDS)] = _any_value(rng)
    elif action == 1 and isinstance(node, list):  # grow, cut or repeat a list
        if node and rng.random() < 0.5:
            del node[rng.randrange(len(node)):]
        else:
            node.extend([rng.choice(node) if node else _any_value(rng)] * rng.choice([1, 2, 17]))
    elif parent is None:
        return _any_value(rng)
    elif action == 2 and isinstance(node, int | float) and not isinstance(node, bool):  # a nearby number
        parent[key] = node + rng.choice([-1, 1]) * rng.choice([1, 2 ** 31, 2 ** 63]) if isinstance(node, int) \
            else node * rng.choice([-1.0, 1e10, 1e300])
    else:
        parent[key] = _any_value(rng)
    return header


def mutate(frames: list[bytes], rng: random.Random, byte_mutate) -> list[bytes] | None:
    """Frames changed in one structural way, or None when libFuzzer's byte mutations should run."""
    if rng.random() < BYTE_SHARE or len(frames) < 2:
        return None
    frames = list(frames)
    choice = rng.random()
    if choice < 0.08:
        frames[0] = rng.choice(TYPES)
    elif choice < 0.16 and len(frames) > 2:  # one tensor frame's bytes, or a frame more or less
        at = rng.randrange(2, len(frames))
        frames[at] = byte_mutate(frames[at]) if rng.random() < 0.7 else b""
    elif choice < 0.2:
        frames.append(rng.choice([b"", b"\0" * 4, b"\0" * 8]))
    else:
        try:
            header = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
            frames[1] = msgpack.packb(mutate_header(header, rng), use_bin_type=True)
        except Exception:  # noqa: BLE001 - a header the byte mutations broke, or a value msgpack cannot pack
            return None
    return frames
