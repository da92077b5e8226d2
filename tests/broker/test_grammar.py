"""Structured outputs in the broker, without a model: llguidance grammars compiled against a real
tokenizer, next-token masks (broker/grammar_state.py), and tokens drawn at random among the allowed ones (what random
weights do) — every bounded schema completes, parses and validates; hostile specs are 400s."""
import json
import threading
import time

import jsonschema
import numpy as np
import pytest

from moebus.broker.grammar import GrammarEngine
from moebus.broker.grammar_state import ACTIVE, OPENING, WAITING, step_masks, with_ready_masks
from moebus.common.errors import RequestError
from moebus.common.model_config import load_config
from moebus.common.protocol import Constraint
from moebus.common.tokenizer import TextTokenizer
from moebus.cuda.kernels.sampling import allowed_ids
from tests.reasoning_model import make_reasoning_model
from tests.structured_schemas import SCHEMAS

MAX_STEPS = 200


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return TextTokenizer(tiny_model, load_config(tiny_model).eos_token_ids)


@pytest.fixture(scope="module")
def engine(tokenizer, tiny_model):
    return GrammarEngine(tokenizer, load_config(tiny_model).vocab_size)


class Row:
    """What step_masks reads of a Sequence."""

    def __init__(self, grammar):
        self.grammar = grammar


def generate(engine, constraints, rng, reasoning_open=None) -> list[list[int]]:
    """Random allowed tokens until each grammar is complete."""
    states = [engine.start(c, reasoning_open) for c in constraints]
    out, done = [[] for _ in states], [False] * len(states)
    for _ in range(MAX_STEPS):
        if all(done):
            return out
        masks = step_masks([Row(s) for s in states], [not d for d in done])
        mask, rows = masks["mask"], masks["mask_rows"]
        assert mask.shape[1] == engine.words and mask.dtype == np.int32
        for i, state in enumerate(states):
            if not done[i]:
                token = int(rng.choice(np.nonzero(allowed_ids(mask[rows[i]].view(np.uint32), engine.vocab_size))[0]))
                out[i].append(token)
                done[i] = state.observe(token, "")
    raise AssertionError(f"a bounded grammar did not complete in {MAX_STEPS} tokens")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_tokens_under_a_bounded_schema_always_give_valid_json(engine, tokenizer, name):
    rng = np.random.default_rng(len(name))
    constraint = Constraint(kind="json_schema", spec=json.dumps(SCHEMAS[name]))
    for tokens in generate(engine, [constraint] * 4, rng):
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMAS[name])


def test_choice_and_regex(engine, tokenizer):
    rng = np.random.default_rng(0)
    choice, regex = generate(engine, [Constraint(kind="choice", spec='["yes", "no", "maybe so"]'),
                                              Constraint(kind="regex", spec=r"[0-9]{3}-[a-c]{2}")], rng)
    assert tokenizer.decode(choice) in ("yes", "no", "maybe so")
    text = tokenizer.decode(regex)
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and set(text[4:]) <= set("abc")


def test_json_object_starts_an_object_without_whitespace(engine, tokenizer):
    # any JSON object is unbounded (random tokens need not end it): its first token opens the object
    mask = engine.start(Constraint(kind="json_object"), None).mask()
    allowed = np.nonzero(allowed_ids(mask.view(np.uint32), engine.vocab_size))[0]
    assert len(allowed) and all(tokenizer.decode([t]).startswith("{") for t in allowed)


def test_forced_tool_call_is_a_hermes_block_with_valid_arguments(engine, tokenizer):
    params = SCHEMAS["refs"]
    spec = {"tools": [{"name": "draw", "parameters": params, "strict": False},
                      {"name": "other", "parameters": None, "strict": False}], "choice": "draw"}
    (tokens,) = generate(engine, [Constraint(kind="tool_calls", spec=json.dumps(spec), param="tools")],
                         np.random.default_rng(1))
    text = tokenizer.decode(tokens)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text[len("<tool_call>\n"): -len("\n</tool_call>")])
    assert list(call) == ["name", "arguments"] and call["name"] == "draw"
    jsonschema.validate(call["arguments"], params)


def test_only_active_rows_that_sample_get_masks(engine):
    states = [engine.start(Constraint(kind="json_object"), None), None, engine.start(Constraint(kind="json_object"), True),
              engine.start(Constraint(kind="json_object"), None)]
    assert states[2].mode == WAITING
    masks = step_masks([Row(s) for s in states], [True, True, True, False])
    assert masks["mask_rows"].tolist() == [0, -1, -1, -1] and masks["mask"].shape == (1, engine.words)
    assert step_masks([Row(None), Row(states[2])], [True, True]) is None  # the plain path: nothing


def test_a_late_mask_sits_its_step_out_unless_nothing_else_can_run(engine):
    import threading
    from concurrent.futures import Future

    late, plain = Row(engine.start(Constraint(kind="json_object"), None)), Row(None)
    slow = Future()
    late.grammar._next = slow  # a mask still being computed
    assert with_ready_masks([plain, late], 0.001, others=False) == [plain]
    threading.Timer(0.05, lambda: slow.set_result(np.zeros(engine.words, np.int32))).start()
    assert with_ready_masks([late], 0.001, others=False) == [late]  # alone: the step waits for it
    assert slow.done()


def test_reasoning_model_may_open_a_block_then_the_constraint_starts_after_it(tmp_path):
    model = make_reasoning_model(tmp_path / "reasoning")
    tokenizer = TextTokenizer(model, load_config(model).eos_token_ids)
    engine = GrammarEngine(tokenizer, load_config(model).vocab_size)
    (think,), close = engine.think_open_ids, engine.think_close
    state = engine.start(Constraint(kind="choice", spec='["ok"]'), reasoning_open=False)
    assert state.mode == OPENING
    allowed = np.nonzero(allowed_ids(state.mask().view(np.uint32), engine.vocab_size))[0]
    assert think in allowed and close not in allowed
    assert not state.observe(think, "<think>") and state.mode == WAITING
    assert step_masks([Row(state)], [True]) is None  # reasoning is free text
    assert not state.observe(close, "<think>hm</think>") and state.mode == ACTIVE
    ok = tokenizer.encode("ok")
    assert [state.observe(t, "") for t in ok][-1] is True


@pytest.mark.parametrize("constraint, match", [
    (Constraint(kind="json_schema", spec='{"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}'),
     "nope"),
    (Constraint(kind="json_schema", spec='{"type": "object"'), "not valid JSON"),
    (Constraint(kind="json_schema", spec='[1, 2]'), "must be an object"),
    (Constraint(kind="json_schema", spec='{"type": "strange"}'), "strange"),
    (Constraint(kind="regex", spec="(unclosed"), "cannot be compiled"),
    (Constraint(kind="choice", spec="[]"), "non-empty"),
    (Constraint(kind="tool_calls", spec='{"tools": [{"name": "f"}], "choice": "g"}', param="tools"), "not one of"),
])
def test_invalid_specs_are_400s_naming_why(engine, constraint, match):
    with pytest.raises(RequestError, match=match) as err:
        engine.start(constraint, None)
    assert err.value.param in (constraint.param, "tool_choice")


def _nested(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


@pytest.mark.parametrize("schema", [
    _nested(300), _nested(3000),  # deep (the api's JSON parser takes ~1000 levels; the broker more)
    {"type": "object", "properties": {f"p{i}": {"enum": [f"v{i}_{j}" for j in range(50)]} for i in range(400)},
     "required": [f"p{i}" for i in range(400)]},  # huge
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},  # recursive
    {"type": "string", "pattern": "(a|b|c|d|e|f|g|h)*" * 40 + "x{1000}"},  # a large regex
])
def test_hostile_schemas_compile_or_fail_in_bounded_time(engine, schema):
    started = time.monotonic()
    outcome = []

    def compile_():  # on a thread, as the broker's tokenizer threads compile (their stacks)
        try:
            outcome.append(engine.start(Constraint(kind="json_schema", spec=schema if isinstance(schema, str)
                                                   else json.dumps(schema)), None))
        except RequestError as e:
            outcome.append(e)

    thread = threading.Thread(target=compile_)
    thread.start()
    thread.join(timeout=30)
    assert outcome and time.monotonic() - started < 10.0
    assert not isinstance(outcome[0], RequestError) or outcome[0].param == "response_format"


def test_a_compiled_grammar_is_reused(engine):
    constraint = Constraint(kind="json_schema", spec=json.dumps(SCHEMAS["nested"]))
    first = engine.start(constraint, None)
    second = engine.start(constraint, None)
    assert first.matcher is not second.matcher  # each sequence its own matcher, copied from the cache
    assert len([g for g in engine._compiled if g]) >= 1


def test_a_planned_step_carries_masks_to_the_last_stage_only(engine, tokenizer):
    """Scheduler -> STEP: the constrained row that samples gets a mask, on the last stage's STEP."""
    from moebus.broker.inflight import InflightStep
    from moebus.broker.scheduler import Scheduler
    from moebus.broker.sequence import Sequence
    from moebus.broker.steps import step_message
    from moebus.common.protocol import Sampling
    from moebus.common.tokenizer import StreamDecoder

    def seq(sid, grammar=None):
        return Sequence(id=sid, client=b"c", prompt=[5, 6, 7], sampling=Sampling(max_tokens=50),
                        decoder=StreamDecoder(tokenizer), stop_ids=tokenizer.stop_ids, max_context=64, grammar=grammar)

    scheduler = Scheduler(max_batch=4, max_queue=4, max_step_tokens=64)
    constrained = seq("b", engine.start(Constraint(kind="choice", spec='["yes", "no"]'), None))
    for s in (seq("a"), constrained):
        scheduler.submit(s)
    plan = scheduler.plan()
    step = InflightStep.__new__(InflightStep)
    step.plan, step.step_id = plan, 1
    step.stage = 0
    first = step_message(step, None, num_stages=2)
    assert first.mask is None and first.mask_rows is None
    step.stage = 1
    last = step_message(step, np.zeros((6, 8), np.float32), num_stages=2)
    assert last.mask_rows.tolist() == [-1, 0] and last.mask.shape == (1, engine.words)
    allowed = np.nonzero(allowed_ids(last.mask[0].view(np.uint32), engine.vocab_size))[0]
    assert allowed.size and all("yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t]))
                                for t in allowed)


def test_a_sequence_finishes_with_stop_when_its_grammar_is_complete(engine, tokenizer):
    from moebus.broker.sequence import Sequence
    from moebus.common.protocol import Sampling
    from moebus.common.tokenizer import StreamDecoder

    seq = Sequence(id="s", client=b"c", prompt=[5], sampling=Sampling(max_tokens=50), decoder=StreamDecoder(tokenizer),
                   stop_ids=tokenizer.stop_ids, max_context=64,
                   grammar=engine.start(Constraint(kind="regex", spec="ab[0-9]"), None))
    text = "".join(seq.accept(t, 0.0) for t in tokenizer.encode("ab7"))
    assert seq.finish_reason == "stop" and text == "ab7"
