"""Every message type round-trips through the wire codec; garbage is refused with WireError."""
import pickle

import msgpack
import numpy as np
import pytest

from moebus.common import protocol as p
from moebus.common import wire

SAMPLES = [
    p.Generate(id="r1", prompt="hi", sampling=p.Sampling(max_tokens=4, temperature=0.5, stop=["\n"], logprobs=2)),
    p.Generate(id="r2", prompt_tokens=[1, 2, 3]),
    p.Generate(id="r3", messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}]),
    p.Generate(id="r4", prompt="x", sampling=p.Sampling(frequency_penalty=0.5, presence_penalty=-1.0, min_p=0.1,
                                                        repetition_penalty=1.3, logit_bias=[(3, 2.5), (9, -100.0)])),
    p.Generate(id="r5", messages=[{"role": "user", "content": "x"}], chat_template_kwargs={"enable_thinking": False},
               tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    p.Cancel(id="r1"),
    p.Tokenize(id="t1", messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}],
               chat_template_kwargs={"enable_thinking": True}, add_generation_prompt=False, token_strs=True),
    p.Tokenize(prompt="hello"),
    p.TokenizeReply(id="t1", tokens=[1, 2], token_strs=["a", "b"], max_context=256),
    p.Detokenize(id="d1", tokens=[1, 2, 3]),
    p.DetokenizeReply(id="d1", text="abc"),
    p.Partial(id="r1", tokens=[5], text="a", logprobs=[-0.5], top_logprobs=[[(5, -0.5), (7, -1.0)]]),
    p.Partial(id="r5", tokens=[5], text="a", logprobs=[-0.5], reasoning_open=True),
    p.Final(id="r1", finish_reason="length", prompt_tokens=3, completion_tokens=4),
    p.Error(id="r1", message="bad", param="max_tokens", status=400),
    p.Vram(reserve_mib=[1700, 600]), p.Vram(), p.Vram(reserve_mib=12.5), p.Vram(query=True),
    p.VramReply(reserve_mib=[1, 2], free_mib=[3, 4], expert_slots=[5, 6], expert_cache_mib=[7, 8], line="x"),
    p.Info(), p.InfoReply(stats={"a": 1, "b": [1, 2]}), p.Ping(), p.Pong(ready=True),
    p.Ready(gpu=1, generation="g", layers=(2, 4), device="cpu", expert_slots=10, pid=5),
    p.Heartbeat(generation="g"), p.Shutdown(),
    p.Step(step_id=3, slots=np.array([0, 1], np.int32), starts=np.array([0, 5], np.int32),
           lengths=np.array([3, 1], np.int32), tokens=np.arange(4, dtype=np.int32),
           temperature=np.zeros(2, np.float32), u=np.array([0.1, 0.2], np.float32)),
    p.Step(step_id=5, slots=np.arange(2, dtype=np.int32), starts=np.zeros(2, np.int32), lengths=np.ones(2, np.int32),
           hidden=np.zeros((2, 8), np.float32), temperature=np.ones(2, np.float32), top_k=np.zeros(2, np.int32),
           top_p=np.ones(2, np.float32), u=np.zeros(2, np.float32),
           logit_params=np.array([[0.5, 0, 1.2, 0], [0, 0, 1, 0.1]], np.float32),
           logit_lengths=np.array([3, 0], np.int32), logit_ids=np.array([4, 9, 2], np.int32),
           logit_counts=np.array([2, 0, -1], np.int32), logit_bias=np.array([0, 0, 3.5], np.float32)),
    p.Step(step_id=7, slots=np.arange(3, dtype=np.int32), starts=np.zeros(3, np.int32), lengths=np.ones(3, np.int32),
           hidden=np.zeros((3, 8), np.float32), mask=np.array([[-1, 5], [3, 0]], np.int32),
           mask_rows=np.array([1, -1, 0], np.int32)),
    p.Generate(id="r6", prompt="x", constraint=p.Constraint(kind="json_schema", spec='{"type": "object"}',
                                                            param="response_format.json_schema.schema")),
    p.Step(step_id=6, top_logprobs=3, logprob_rows=np.array([0, 2], np.int32), slots=np.arange(3, dtype=np.int32),
           starts=np.zeros(3, np.int32), lengths=np.ones(3, np.int32), hidden=np.zeros((3, 8), np.float32)),
    p.Step(step_id=4, slots=np.zeros(1, np.int32), starts=np.zeros(1, np.int32), lengths=np.ones(1, np.int32),
           hidden=np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)),
    p.Step(step_id=9, tokens_from=8, slots=np.array([2, 0], np.int32), starts=np.array([40, 7], np.int32),
           lengths=np.ones(2, np.int32), temperature=np.zeros(2, np.float32), u=np.zeros(2, np.float32)),
    p.Step(step_id=10, tokens_from=9, tokens_rows=np.array([0, 2], np.int32), slots=np.array([2, 1], np.int32),
           starts=np.array([41, 5], np.int32), lengths=np.ones(2, np.int32)),
    # a held chunk continued: its image rows stay on the worker; with tokens_from, its ids too
    p.Step(step_id=11, held_row=1, slots=np.array([2, 1], np.int32), starts=np.array([41, 0], np.int32),
           lengths=np.array([1, 3], np.int32), tokens=np.arange(4, dtype=np.int32)),
    p.Step(step_id=12, tokens_from=11, tokens_rows=np.array([0, 0], np.int32), held_row=1,
           slots=np.array([2, 1], np.int32), starts=np.array([42, 0], np.int32), lengths=np.array([1, 3], np.int32)),
    p.StepReply(step_id=3, generation="g", compute_s=0.01, tokens=np.array([1, 2], np.int32),
                logprobs=np.array([-1.0, -2.0], np.float32), top_ids=np.zeros((2, 3), np.int32),
                top_logprobs=np.zeros((2, 3), np.float32)),
    p.StepReply(step_id=4, generation="g", compute_s=0.02, tokens=np.array([5, 0], np.int32),
                logprobs=np.array([-0.5, 0.0], np.float32), pending_rows=np.array([1], np.int32)),
    p.WorkerError(generation="g", step_id=3, message="boom", fatal=True),
    p.Generate(id="r4", messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
               images=[np.frombuffer(b"\x89PNG fake", np.uint8), np.frombuffer(b"GIF89a", np.uint8)]),
    p.Step(step_id=5, slots=np.zeros(1, np.int32), starts=np.zeros(1, np.int32), lengths=np.full(1, 3, np.int32),
           tokens=np.arange(3, dtype=np.int32), embeds=np.ones((2, 8), np.float32),
           embed_rows=np.array([0, 2], np.int32)),
    p.VisionReady(generation="v", gpu=0, device="cpu", pid=9, device_bytes=1 << 20, num_image_tokens=4,
                  hidden_size=8, start_s=0.2),
    p.VisionReady(generation="v", gpu=0, device="cuda", pid=9, device_bytes=801 << 20, measured_bytes=1433 << 20,
                  num_image_tokens=4, hidden_size=8, start_s=0.2),
    p.Encode(encode_id=2, request_id="r4", images=[np.frombuffer(b"abc", np.uint8)]),
    p.EncodeReply(encode_id=2, generation="v", compute_s=0.1, embeds=np.ones((4, 8), np.float32)),
    p.EncodeReply(encode_id=4, generation="v", embeds=np.ones((4, 8), np.float32), measured_bytes=421 << 20),
    p.EncodeReply(encode_id=3, generation="v", error="image 1 is not an image", image=1),
]


def test_every_message_type_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(p.MESSAGES.values())


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    frames = [bytes(f) for f in wire.encode(message)]
    back = wire.decode(frames)
    assert type(back) is type(message)
    for name in type(message).model_fields:
        a, b = getattr(message, name), getattr(back, name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        elif isinstance(a, list) and a and isinstance(a[0], np.ndarray):  # a tensor list (images)
            assert len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))
        else:
            assert a == b or (isinstance(a, tuple) and list(a) == list(b))


def test_tensors_are_raw_frames_not_msgpack():
    step = next(m for m in SAMPLES if isinstance(m, p.Step) and m.hidden is not None)
    frames = wire.encode(step)
    header = msgpack.unpackb(bytes(frames[1]))
    assert "hidden" not in header and header["_tensors"]["hidden"][1:] == ["float32", list(step.hidden.shape)]
    assert bytes(frames[2 + header["_tensors"]["hidden"][0]]) == step.hidden.tobytes()


@pytest.mark.parametrize("frames,match", [
    ([b"GENERATE"], "at least 2 frames"),
    ([b"NOPE", b"\x80"], "unknown message type"),
    ([b"GENERATE", pickle.dumps({"id": "x"})], "not valid msgpack"),
    ([b"GENERATE", b"\xff\xfe\xfd"], "not valid msgpack"),
    ([b"GENERATE", msgpack.packb([1, 2])], "must be a msgpack map"),
    ([b"GENERATE", msgpack.packb({"id": "x", "evil": 1})], "evil"),
    ([b"GENERATE", msgpack.packb({"id": 5})], "id"),
    ([b"GENERATE", msgpack.packb({"id": "x"})] + [b""] * 40, "tensor frames exceed"),
    ([b"STEP", msgpack.packb({"step_id": 1, "_tensors": {"slots": [0, "float32", [3]]}}), b"\0" * 8],
     "does not hold"),
    ([b"STEP", msgpack.packb({"step_id": 1, "_tensors": {"slots": [0, "object", [1]]}}), b"\0" * 8],
     "not allowed"),
    ([b"STEP", msgpack.packb({"step_id": 1, "_tensors": {"bogus": [0, "int32", [1]]}}), b"\0" * 4],
     "unexpected tensors"),
    ([b"GENERATE", msgpack.packb({"id": "x", "sampling": {"max_tokens": 0}})], "max_tokens"),
    ([b"GENERATE", msgpack.packb({"id": "x", "constraint": {"kind": "lark", "spec": "start: x"}})], "kind"),
    ([b"GENERATE", msgpack.packb({"id": "x", "constraint": {"kind": "regex", "spec": "a" * 300_000}})], "spec"),
    ([b"STEP", msgpack.packb({"step_id": 1, "_tensors": {"slots": [0, "int32", [1]], "starts": [1, "int32", [1]],
                                                         "lengths": [2, "int32", [1]], "mask": [3, "int32", [1, 2]],
                                                         "mask_rows": [4, "int32", [1]]}}),
      b"\0" * 4, b"\0" * 4, b"\1\0\0\0", b"\0" * 8, b"\1\0\0\0"], "mask_rows"),
    ([b"STEP", msgpack.packb({"step_id": 1, "_tensors": {"slots": [0, "int32", [1]], "starts": [1, "int32", [1]],
                                                         "lengths": [2, "int32", [1]], "mask": [3, "int32", [1, 2]]}}),
      b"\0" * 4, b"\0" * 4, b"\1\0\0\0", b"\0" * 8], "mask and mask_rows"),
    ([b"GENERATE", msgpack.packb({"id": "x", "sampling": {"logit_bias": [[3, 1.0], [3, 2.0]]}})], "unique"),
    ([b"GENERATE", msgpack.packb({"id": "x", "sampling": {"logit_bias": [[3, 101.0]]}})], "logit_bias"),
    ([b"GENERATE", msgpack.packb({"id": "x", "sampling": {"repetition_penalty": 0.0}})], "repetition_penalty"),
])
def test_garbage_is_refused(frames, match):
    with pytest.raises(wire.WireError, match=match):
        wire.decode(frames)


def test_huge_header_is_refused():
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode([b"GENERATE", b"\x00" * (wire.MAX_HEADER_BYTES + 1)])


def test_a_refused_request_keeps_its_id_so_the_error_reaches_it():
    frames = [b"GENERATE", msgpack.packb({"id": "req-7", "prompt": "x", "sampling": {"temperature": 1e9}})]
    with pytest.raises(wire.WireError) as info:
        wire.decode(frames)
    assert info.value.request_id == "req-7"


@pytest.mark.parametrize("rows,n", [([2, 1], 2), ([1, 1], 2), ([3], 2), ([-1], 2), ([0], 0)])
def test_step_logprob_rows_must_be_ascending_rows_of_the_step(rows, n):
    with pytest.raises(ValueError, match="logprob_rows"):
        p.Step(step_id=1, top_logprobs=n, logprob_rows=np.array(rows, np.int32), slots=np.arange(3, dtype=np.int32),
               starts=np.zeros(3, np.int32), lengths=np.ones(3, np.int32))


@pytest.mark.parametrize("extra", [{"tokens": np.zeros(2, np.int32)}, {"hidden": np.zeros((2, 8), np.float32)},
                                   {"lengths": np.array([1, 2], np.int32)}])
def test_a_step_with_tokens_from_takes_one_token_per_row_and_carries_none(extra):
    fields = dict(step_id=2, tokens_from=1, slots=np.arange(2, dtype=np.int32), starts=np.zeros(2, np.int32),
                  lengths=np.ones(2, np.int32))
    with pytest.raises(ValueError, match="tokens_from"):
        p.Step(**{**fields, **extra})


@pytest.mark.parametrize("extra", [{"held_row": 2}, {"held_row": 0}, {"held_row": -1},
                                   {"lengths": np.array([1, 3, 2], np.int32)}])
def test_a_held_row_is_a_prompt_chunks_row_and_only_its_ids_are_left_out(extra):
    fields = dict(step_id=2, tokens_from=1, held_row=1, slots=np.arange(2, dtype=np.int32),
                  starts=np.zeros(2, np.int32), lengths=np.array([1, 3], np.int32))
    p.Step(**fields)
    with pytest.raises(ValueError, match="held_row|tokens_from|greater|shape"):
        p.Step(**{**fields, **extra, **({"slots": np.arange(3, dtype=np.int32), "starts": np.zeros(3, np.int32)}
                                       if "lengths" in extra else {})})


@pytest.mark.parametrize("extra", [{"tokens_from": None, "tokens": np.zeros(2, np.int32)},
                                   {"tokens_rows": np.array([0, -1], np.int32)},
                                   {"tokens_rows": np.array([0, 1, 2], np.int32)}])
def test_tokens_rows_come_with_tokens_from_one_per_row_and_name_rows(extra):
    fields = dict(step_id=2, tokens_from=1, slots=np.arange(2, dtype=np.int32), starts=np.zeros(2, np.int32),
                  lengths=np.ones(2, np.int32), tokens_rows=np.array([1, 3], np.int32))
    p.Step(**fields)
    with pytest.raises(ValueError, match="tokens_rows|2 entries|shape|length"):
        p.Step(**{**fields, **extra})



@pytest.mark.parametrize("rows", [np.array([1, 1], np.int32), np.array([2, 0], np.int32), np.array([-1], np.int32),
                                  np.zeros((1, 1), np.int32), np.array([0.5])])
def test_step_reply_pending_rows_must_be_ascending_distinct_rows(rows):
    with pytest.raises(ValueError):
        p.StepReply(step_id=1, generation="g", tokens=np.zeros(3, np.int32), pending_rows=rows)
