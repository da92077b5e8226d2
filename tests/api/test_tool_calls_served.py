"""Tool calls end to end: a real ``moebus serve`` of a scripted tiny model (init_model's ``script``:
weights constructed so that greedy decoding writes SCRIPT after any prompt; transformers checks that
it does) with the Qwen3-like template, asked through the openai SDK with tools, whole and streamed;
the stream is accumulated by the SDK's own ChatCompletionStreamState. The script reasons, says a
sentence and calls two tools, so the reasoning split, the content before the calls and the calls'
argument pieces all go over the wire."""
import json

import pytest

from tests.api.helpers import openai_sdk
from tests.common.test_chat_template_fidelity import TOOLS
from tests.reasoning_model import TAGS, make_reasoning_model
from tests.service import Service, running

transformers = pytest.importorskip("transformers")
REASONING = "The user wants the weather in Oslo and a sum."
CONTENT = "Let me check both."
CALLS = [("get_weather", '{"city": "Oslo", "unit": "celsius"}'), ("sum", '{"a": 2, "b": 3}')]
SCRIPT = (f"<think>\n{REASONING}\n</think>\n\n{CONTENT}\n"
          + "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>' for name, args in CALLS))
USER = [{"role": "user", "content": "What is the weather in Oslo, and what is 2 + 3?"}]
MAX_CONTEXT = 1536  # the tools' JSON runs to ~600 tokens of the tiny tokenizer
MAX_TOKENS = 100  # the script is ~45 tokens: it ends by itself


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_reasoning_model(tmp_path_factory.mktemp("scripted") / "tool_caller", script=SCRIPT)


@pytest.fixture(scope="module")
def client(model_dir):
    with running(Service(model_dir.parent, model_dir, max_context=MAX_CONTEXT)) as svc, openai_sdk(svc.base_url) as c:
        yield c


def script_tokens(hf_tokenizer) -> list[str]:
    """The script's pieces, in order: the tokens added for it (the template's tags come after)."""
    added = sorted(hf_tokenizer.added_tokens_decoder.items())
    return [t.content for _, t in added if not t.special and t.content not in TAGS]


def test_transformers_writes_the_script(model_dir, hf_tokenizer):
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for tools in (None, TOOLS):
        text = hf_tokenizer.apply_chat_template(USER, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = hf_tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
        assert hf_tokenizer.decode(out, skip_special_tokens=True) == SCRIPT
        assert out[-1] == hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert "".join(script_tokens(hf_tokenizer)) == SCRIPT and len(out) == len(script_tokens(hf_tokenizer)) + 1


def ask(client, stream: bool, **kwargs):
    args = {"model": "m", "messages": USER, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0, **kwargs}
    return client.chat.completions.create(stream=stream, **args)


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_whole_answer(client):
    out = ask(client, stream=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert calls_of(choice.message) == CALLS
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    assert [json.loads(args) for _, args in calls_of(choice.message)] == [{"city": "Oslo", "unit": "celsius"},
                                                                          {"a": 2, "b": 3}]


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_answer_through_the_sdk_accumulation(client, n):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState(input_tools=TOOLS)
    events, chunks = [], []
    for chunk in ask(client, stream=True, n=n):
        chunks.append(chunk)
        events += state.handle_chunk(chunk)
    final = state.get_final_completion()
    assert len(final.choices) == n
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT
        assert choice.message.model_extra["reasoning_content"] == REASONING
        assert calls_of(choice.message) == CALLS
    for index in range(n):
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == index]
        check_deltas(deltas)
    argument_events = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert {e.name for e in argument_events} == {"get_weather", "sum"}
    done = [(e.name, e.arguments) for e in events if e.type == "tool_calls.function.arguments.done"]
    assert sorted(done) == sorted(CALLS * n)  # the events of the choices interleave


def check_deltas(deltas) -> None:
    """A call's first delta names it; its arguments follow in several pieces, each delta saying
    only what is new; no markup reaches the content."""
    fragments = [(k, call) for k, d in enumerate(deltas) for call in d.tool_calls or []]
    firsts = [(k, call) for k, call in fragments if call.id]
    assert [(call.index, call.type, call.function.name) for _, call in firsts] == [
        (0, "function", "get_weather"), (1, "function", "sum")]
    later = [call for _, call in fragments if not call.id]
    assert all(c.type is None and c.function.name is None and c.function.arguments for c in later)
    weather_pieces = [c.function.arguments for _, c in fragments if c.index == 0 and c.function.arguments]
    assert len(weather_pieces) > 2 and "".join(weather_pieces) == CALLS[0][1]
    assert firsts[0][0] < firsts[1][0]  # the first call went out before the second began
    content = "".join(d.content or "" for d in deltas)
    assert content == CONTENT and "<" not in content
    assert max(k for k, d in enumerate(deltas) if d.content) < firsts[0][0]  # the content streamed first


def test_cut_off_in_the_arguments(client, hf_tokenizer):
    """The length runs out inside the first call's arguments: the call is what was written of it."""
    pieces = script_tokens(hf_tokenizer)
    opening = SCRIPT.index('{"city"') + 1
    max_tokens = next(k for k in range(len(pieces)) if len("".join(pieces[:k])) > opening + 4)
    written = "".join(pieces[:max_tokens])
    want = [("get_weather", written[SCRIPT.index('{"city"'):])]
    out = ask(client, stream=False, max_tokens=max_tokens)
    assert out.choices[0].finish_reason == "length" and calls_of(out.choices[0].message) == want
    streamed = "".join(call.function.arguments or "" for chunk in ask(client, stream=True, max_tokens=max_tokens)
                       for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices)
    assert streamed == want[0][1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tools", ["tool_choice none", "no tools"])
def test_without_tools_the_calls_are_content(client, stream, tools):
    args = {"model": "m", "messages": USER, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if tools == "tool_choice none":
        args.update(tools=TOOLS, tool_choice="none")
    out = client.chat.completions.create(**args)
    if stream:
        deltas = [c.choices[0].delta for c in out if c.choices]
        content = "".join(d.content or "" for d in deltas)
        assert not any(d.tool_calls for d in deltas)
    else:
        content = out.choices[0].message.content
        assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert content == SCRIPT.split("</think>\n\n", 1)[1]
