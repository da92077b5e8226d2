"""Structured outputs on a thinking model: the constraint starts after the reasoning block. A served
scripted tiny model (tests/reasoning_model.py) whose template opens ``<think>`` in the generation
prompt reasons, closes the block and answers; under a schema its reasoning stays as written and its
answer is valid JSON, whole and streamed. (An answer that opens the block itself is
tests/broker/test_grammar.py's: this tiny tokenizer writes ``<think>`` in pieces, Qwen3's in one.)"""
import json

import jsonschema
import pytest

from tests.api.helpers import openai_sdk
from tests.reasoning_model import make_reasoning_model
from tests.service import Service, running

REASONING = "The user wants a city and a number of days."
SCRIPT = f'{REASONING}\n</think>\n\n{{"city":"Oslo","days":3}}'
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
USER = [{"role": "user", "content": "Plan a trip."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = make_reasoning_model(tmp_path_factory.mktemp("scripted") / "thinker", opens_thinking=True,
                                     script=SCRIPT)
    with running(Service(model_dir.parent, model_dir, max_context=512)) as svc, openai_sdk(svc.base_url) as c:
        yield c


def test_unconstrained_the_model_writes_its_script(client):
    out = client.chat.completions.create(model="m", messages=USER, max_tokens=80, temperature=0)
    assert out.choices[0].message.model_extra["reasoning_content"] == REASONING
    assert json.loads(out.choices[0].message.content) == {"city": "Oslo", "days": 3}


def test_reasoning_is_free_and_the_answer_follows_the_schema(client):
    out = client.chat.completions.create(model="m", messages=USER, max_tokens=80, temperature=0.8, n=2,
                                         response_format=FORMAT)
    for choice in out.choices:
        assert choice.message.model_extra["reasoning_content"] == REASONING
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"


def test_streamed(client):
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="m", messages=USER, max_tokens=80, temperature=0, stream=True,
                                                response_format=FORMAT):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert reasoning == REASONING
    jsonschema.validate(json.loads(content), SCHEMA)
