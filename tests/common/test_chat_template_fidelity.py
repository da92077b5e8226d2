"""A Qwen3-style template with ``tools`` and ``enable_thinking`` renders as transformers'
``apply_chat_template`` renders it (transformers is the oracle), over the conversation shapes that
the template treats differently."""
import pytest

from moebus.common.tokenizer import TextTokenizer
from tests.reasoning_model import make_reasoning_model

transformers = pytest.importorskip("transformers")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, \"now\" <fast>",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "sum", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}}}}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}
CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "Hi there"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "reasoning_history": [
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nFirst answer."},
        {"role": "user", "content": "Second?"}],
    "tool_round_trip": [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Oslo and 2+3?"},
        {"role": "assistant", "content": None, "reasoning_content": "I need tools.",
         "tool_calls": [CALL, {"id": "call_2", "type": "function",
                               "function": {"name": "sum", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
        {"role": "assistant", "content": "Sunny and 5."},
        {"role": "user", "content": "Thanks!"}],
}


@pytest.fixture(scope="module", params=[False, True], ids=["hybrid", "opens_thinking"])
def model_dir(request, tmp_path_factory):
    return make_reasoning_model(tmp_path_factory.mktemp("qwen3_like") / "m", opens_thinking=request.param)


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("thinking", [None, True, False], ids=["default", "thinking", "no_thinking"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renders_as_transformers(model_dir, name, tools, thinking):
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = TextTokenizer(model_dir)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    messages = CONVERSATIONS[name]
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    got = ours.render_chat([dict(m) for m in messages], tools=tools, template_kwargs=kwargs)
    assert got == want
    assert ours.encode(got) == hf.encode(want, add_special_tokens=False)
    if tools:
        assert '"description": "Weather in a city, \\"now\\" <fast>"' in got  # tojson as transformers has it


def test_where_the_answer_begins(model_dir):
    tok = TextTokenizer(model_dir)
    user = CONVERSATIONS["one_turn"]
    opens = "{%- elif true %}" in tok.chat_template  # made with opens_thinking
    assert tok.emits_reasoning
    assert tok.opens_reasoning(tok.render_chat(user)) is opens
    assert tok.opens_reasoning(tok.render_chat(user, template_kwargs={"enable_thinking": False})) is False


def test_a_plain_chatml_model_has_no_reasoning(tiny_model):
    tok = TextTokenizer(tiny_model)
    assert not tok.emits_reasoning and tok.opens_reasoning("<think>\n") is None
