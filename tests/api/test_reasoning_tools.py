"""Reasoning output, tools and chat_template_kwargs through the openai SDK against a real ``moebus
serve`` of a tiny model with a Qwen3-like template (tests/reasoning_model.py) whose generation
prompt opens a ``<think>`` block unless ``enable_thinking`` is false. The tags are single tokens,
so logit_bias can make the random model write them; transformers is the oracle of every prompt."""
import pytest

from tests.api.helpers import openai_sdk
from tests.api.oracle import Oracle
from tests.common.test_chat_template_fidelity import CONVERSATIONS, TOOLS
from tests.reasoning_model import make_reasoning_model
from tests.service import Service, running

transformers = pytest.importorskip("transformers")
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MAX_CONTEXT = 1536  # a prompt with the tools' JSON runs to ~600 tokens of the tiny tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_reasoning_model(tmp_path_factory.mktemp("reasoning") / "qwen3_like", opens_thinking=True)


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_dir):
    with running(Service(tmp_path_factory.mktemp("reasoning_svc"), model_dir, max_context=MAX_CONTEXT)) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service):
    with openai_sdk(service.base_url) as c:
        yield c


@pytest.fixture(scope="module")
def root_client(service):
    """The SDK at the server's root, for /tokenize and /detokenize (vLLM's paths, outside /v1)."""
    with openai_sdk(service.base_url, path="") as c:
        yield c


def tag_id(hf_tokenizer, tag: str) -> str:
    return str(hf_tokenizer.convert_tokens_to_ids(tag))


def chat(client, stream: bool, **kwargs):
    """(reasoning, content, finish_reason, tool_calls) of a greedy chat, whole or assembled from a stream."""
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    args = {"model": "m", "messages": USER, "max_tokens": 8, "temperature": 0, "stream": stream, **kwargs,
            "extra_body": extra}
    out = client.chat.completions.create(**args)
    if not stream:
        m = out.choices[0].message
        return (m.model_extra.get("reasoning_content"), m.content, out.choices[0].finish_reason, m.tool_calls)
    reasoning, content, finish, calls = "", "", None, []
    for chunk in out:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return reasoning or None, content or None, finish, calls or None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_thinking_answer_is_reasoning_content(client, stream):
    reasoning, content, finish, _ = chat(client, stream)
    plain = chat(client, stream, extra_body=NO_THINKING)
    assert reasoning and content is None and finish == "length"  # the block never closed
    assert plain[0] is None and plain[1]  # enable_thinking false: the prompt closed the block


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_first_close_tag_ends_the_reasoning(client, hf_tokenizer, stream):
    close = tag_id(hf_tokenizer, "</think>")
    reasoning, content, _, _ = chat(client, stream, logit_bias={close: 100})
    assert reasoning is None and content == "</think>" * 7


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answer_that_opens_a_block(client, hf_tokenizer, stream):
    opening = tag_id(hf_tokenizer, "<think>")
    reasoning, content, _, _ = chat(client, stream, logit_bias={opening: 100}, extra_body=NO_THINKING)
    assert reasoning == "<think>" * 7 and content is None


def test_reasoning_splits_where_the_model_closes_the_block(client, model_dir, hf_tokenizer):
    """A bias on </think> that the greedy oracle finds makes the model close its block mid-answer."""
    tok_close = int(tag_id(hf_tokenizer, "</think>"))
    oracle = Oracle(model_dir)
    prompt = hf_tokenizer.encode(hf_tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True),
                                 add_special_tokens=False)
    for bias in [b / 2 for b in range(80)]:
        ids = oracle.greedy(prompt, 10, presence=2.0, frequency=2.0, logit_bias={tok_close: bias})
        if tok_close in ids[2:7] and ids.count(tok_close) == 1:
            break
    else:
        pytest.fail("no bias closes the block mid-answer")
    at = ids.index(tok_close)
    for stream in (False, True):
        reasoning, content, _, _ = chat(client, stream, max_tokens=10, presence_penalty=2.0, frequency_penalty=2.0,
                                        logit_bias={str(tok_close): bias})
        assert reasoning == hf_tokenizer.decode(ids[:at]).strip("\n")
        assert content == hf_tokenizer.decode(ids[at + 1:]).lstrip("\n")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_unfinished_tool_call_stays_content(client, hf_tokenizer, stream):
    opening = tag_id(hf_tokenizer, "<tool_call>")
    reasoning, content, finish, calls = chat(client, stream, tools=TOOLS, logit_bias={opening: 100},
                                             extra_body=NO_THINKING)
    assert content == "<tool_call>" * 8 and calls is None and finish == "length"


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_tools_reach_the_template(client, hf_tokenizer, tool_choice):
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    out = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=2, temperature=0,
                                         extra_body=NO_THINKING, **extra)
    tools = None if tool_choice == "none" else TOOLS  # "none": the model is not told of the tools
    want = hf_tokenizer.apply_chat_template(USER, tools=tools, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=False)
    assert out.usage.prompt_tokens == len(hf_tokenizer.encode(want, add_special_tokens=False))


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [True, False])
def test_tokenize_renders_as_transformers(root_client, hf_tokenizer, name, thinking):
    messages = CONVERSATIONS[name]
    want = hf_tokenizer.encode(hf_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                                add_generation_prompt=True, enable_thinking=thinking),
                               add_special_tokens=False)
    got = root_client.post("/tokenize", cast_to=object, body={
        "model": "m", "messages": messages, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": thinking},
        "return_token_strs": True})
    assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == MAX_CONTEXT
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(want)
    back = root_client.post("/detokenize", cast_to=object, body={"model": "m", "tokens": got["tokens"]})
    assert back["prompt"] == back["content"] == hf_tokenizer.decode(want)


def test_tokenize_a_prompt_both_ways(root_client, hf_tokenizer):
    for body in ({"prompt": "the cache <think>"}, {"content": "the cache <think>"}):
        got = root_client.post("/tokenize", cast_to=object, body=body)
        assert got["tokens"] == hf_tokenizer.encode("the cache <think>", add_special_tokens=False)
    no_gen = root_client.post("/tokenize", cast_to=object, body={"messages": USER, "add_generation_prompt": False})
    want = hf_tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=False)
    assert no_gen["tokens"] == hf_tokenizer.encode(want, add_special_tokens=False)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, "tools"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "with_pieces": True}, "with_pieces"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 100000]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenize_refuses_bad_requests(root_client, path, body, param):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        root_client.post(path, cast_to=object, body=body)
    assert err.value.body["param"] == param
