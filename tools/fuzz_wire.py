"""Coverage-guided fuzz of the wire codec (atheris, i.e. libFuzzer over instrumented Python).

Each input is a list of ZeroMQ frames joined by ``SEPARATOR``. The check: ``wire.decode`` returns a message that
encodes and decodes again to the same frames, or raises a WireError that one of its checks meant
(a ``CodecBug``, an exception no check named, is a finding; so is anything else that escapes), and
a decoded message's typed numbers fit an int64 or are finite (tests/common/wire_invariants.py).

    # a long run: seeds (a valid encoding of every message type) are written into CORPUS first
    PYTHONPATH=$PWD python tools/fuzz_wire.py --seed CORPUS -max_total_time=600 CORPUS
    # replay files (a crash-* file libFuzzer wrote, or tests/fuzz/regressions/*)
    PYTHONPATH=$PWD python tools/fuzz_wire.py tests/fuzz/regressions/*

Inputs are mutated mostly in structure (tests/fuzz/wire_mutator.py: the msgpack header unpacked,
one value changed, packed again), a quarter by libFuzzer's byte mutations; ``--bytes-only`` turns
the structural mutator off. Every other argument goes to libFuzzer (``-help=1`` lists them); ``-dict=`` and ``-keep_seed=1``
are added unless given.
CI runs a few seconds of it (tests/fuzz/test_wire_atheris.py)."""
from __future__ import annotations

import os
import random
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["moebus.common.wire", "moebus.common.protocol", "msgpack"]):
    from moebus.common import protocol, wire
from tests.common.wire_invariants import check_decoded  # noqa: E402 - after the instrumented imports
from tests.fuzz import wire_mutator  # noqa: E402

MAX_FRAMES = 40  # past wire.MAX_TENSOR_FRAMES + 2, so the frame-count check is reachable
# frames are joined by a separator rather than length-prefixed: a mutation that inserts or erases
# bytes inside a frame (a fixint grown into a uint64) must not shift every frame after it
SEPARATOR = b"\x00\xff<frame>\xff\x00"


def split_frames(data: bytes) -> list[bytes]:
    return data.split(SEPARATOR, MAX_FRAMES - 1)


def join_frames(frames) -> bytes:
    frames = [bytes(f) for f in frames]
    assert not any(SEPARATOR in f for f in frames), "a seed frame holds the separator"
    return SEPARATOR.join(frames)


def _feature_source(classes: list) -> str:
    """Python source of ``decoded(message)`` and ``refused(msg_type)``: one branch per message type
    and, in ``decoded``, one per field that is set. pydantic validates in compiled code that
    atheris cannot see, so without these every valid message (and every refusal by a validator)
    would look the same to libFuzzer, and it would keep one seed of 24 and explore none of the
    others' fields."""
    lines = ["def decoded(m, T):"]
    for i, cls in enumerate(classes):
        lines.append(f"    if type(m) is T[{i}]:")
        lines += [f"        if m.{name} is not None: pass" for name in cls.model_fields]
        lines.append("        return")
    lines.append("def refused(t, N):")
    lines += [f"    if t == N[{i}]: return" for i in range(len(classes))]
    return "\n".join(lines) + "\n"


def _features():
    classes = list(protocol.MESSAGES.values())
    names = [cls.TYPE for cls in classes]
    space: dict = {}
    exec(compile(_feature_source(classes), "<fuzz_wire features>", "exec"), space)  # noqa: S102 - our own source
    decoded, refused = (atheris.instrument_func(space[n]) for n in ("decoded", "refused"))
    return lambda m: decoded(m, classes), lambda t: refused(t, names)


DECODED, REFUSED = _features()


def check(data: bytes) -> None:
    """One fuzz input. Returns quietly, or raises (libFuzzer then saves the input as crash-*)."""
    try:
        message = wire.decode(split_frames(data))
    except wire.CodecBug:
        raise
    except wire.WireError as e:
        REFUSED(e.msg_type)
        return
    DECODED(message)
    check_decoded(message)


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    """libFuzzer's custom mutator: mostly structural (tests/fuzz/wire_mutator.py), else its own."""
    frames = wire_mutator.mutate(split_frames(data), random.Random(seed), lambda b: atheris.Mutate(b, len(b) + 16))
    out = SEPARATOR.join(frames) if frames is not None else b""
    return out if frames is not None and len(out) <= max_size else atheris.Mutate(data, max_size)


def seed_messages() -> list:
    """One valid message of every type: the samples of the codec's round-trip test."""
    from tests.common.test_wire import SAMPLES

    missing = set(protocol.MESSAGES.values()) - {type(m) for m in SAMPLES}
    assert not missing, f"no seed for {sorted(c.__name__ for c in missing)}"
    return SAMPLES


def write_seeds(corpus: str) -> int:
    os.makedirs(corpus, exist_ok=True)
    messages = seed_messages()
    for i, message in enumerate(messages):
        with open(os.path.join(corpus, f"seed-{i:03d}-{message.TYPE.decode().lower()}"), "wb") as f:
            f.write(join_frames(wire.encode(message)))
    return len(messages)


def write_dictionary(path: str) -> None:
    """libFuzzer dictionary: the type names and the msgpack-packed field names, which a byte-level
    mutator would rarely guess."""
    import msgpack

    words = set(protocol.MESSAGES) | {wire.TENSORS_KEY.encode()} | {d.encode() for d in wire.TENSOR_DTYPES}
    for cls in (*protocol.MESSAGES.values(), protocol.Sampling):
        words |= {name.encode() for name in cls.model_fields}
    entries = [SEPARATOR, *sorted(words), *sorted(msgpack.packb(w.decode()) for w in words), *_edge_values(msgpack)]
    with open(path, "w") as f:
        f.writelines('"' + "".join(f"\\x{b:02x}" for b in w) + '"\n' for w in entries)


def _edge_values(msgpack) -> list[bytes]:
    """msgpack encodings of the numbers at the edges of the dtypes receivers use (int32, int64,
    uint64, float specials): a byte mutator turns a fixint 9 into one of these only by luck."""
    ints = [-1, 2 ** 31 - 1, 2 ** 31, -(2 ** 31) - 1, 2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, -(2 ** 63)]
    specials = [float("inf"), float("-inf"), float("nan")]
    doubles = specials + [1e300, -0.0, 2.0 ** 64]
    return ([msgpack.packb(v) for v in ints + doubles]
            + [msgpack.packb(v, use_single_float=True) for v in specials])


def main(argv: list[str]) -> None:
    args = list(argv[1:])
    if "--seed" in args:
        at = args.index("--seed")
        corpus = args[at + 1]
        del args[at:at + 2]
        print(f"fuzz_wire: wrote {write_seeds(corpus)} seeds into {corpus}", flush=True)
    if not any(a.startswith("-keep_seed=") for a in args):
        args.insert(0, "-keep_seed=1")  # a seed of every type stays a parent, coverage or not
    if not any(a.startswith("-dict=") for a in args):
        # one fixed file, same content every run, replaced atomically: nothing piles up in /tmp
        # (libFuzzer ends the process without running Python's clean-ups)
        path = os.path.join(tempfile.gettempdir(), "moebus-fuzz-wire.dict")
        write_dictionary(f"{path}.{os.getpid()}")
        os.replace(f"{path}.{os.getpid()}", path)
        args.insert(0, f"-dict={path}")
    byte_only = "--bytes-only" in args  # libFuzzer's byte mutations alone (to compare)
    args = [a for a in args if a != "--bytes-only"]
    atheris.Setup([argv[0], *args], check, **({} if byte_only else {"custom_mutator": mutate}))
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
