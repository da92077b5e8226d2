"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

from flask import Blueprint, current_app, request

from moebus.api.images import count_images, take_images
from moebus.api.link import current_link as link
from moebus.api.responses import ChatFormatter, CompletionFormatter
from moebus.api.schemas import ChatRequest, CompletionRequest, parse_body
from moebus.api.streaming import answer
from moebus.common.errors import NotFound, RequestError

bp = Blueprint("openai", __name__)


def _client_gone():
    """A callable that says whether the HTTP client has gone (waitress tells, with its request
    lookahead on); None where the server cannot tell."""
    return request.environ.get("waitress.client_disconnected")


def _start(formatter, n: int, start_one) -> list:
    """One broker request per choice; if one cannot start, those already started are cancelled."""
    streams = []
    try:
        for index in range(n):
            streams.append(start_one(index, formatter.request_id(index)))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


@bp.post("/v1/chat/completions")
def chat_completions():
    req = parse_body(ChatRequest)
    formatter = ChatFormatter(link().model()["name"], req.top_n, req.include_usage, req.n, req.calls_tools)
    # logprobs: true asks the broker for at least one top token, which brings the tokens' texts too
    logprobs = max(req.top_n, 1) if req.top_n is not None else 0
    sampling = req.sampling(req.max_completion_tokens or req.max_tokens, logprobs)
    messages, images = _images([m.to_broker() for m in req.messages])
    # the choices carry the same images: the broker encodes them once for all (broker/vision_groups.py)
    group = {"image_group": formatter.id, "image_group_size": req.n} if images and req.n > 1 else {}
    constraint = req.constraint()  # structured output (api/structured.py)
    streams = _start(formatter, req.n, lambda i, rid: link().client.chat(
        messages, request_id=rid, images=images, tools=req.template_tools(), constraint=constraint,
        chat_template_kwargs=req.chat_template_kwargs, **group, **req.choice_sampling(sampling, i)))
    return answer(streams, formatter, _client_gone(), req.stream, current_app.extensions["moebus.stopping"])


def _images(messages: list[dict]) -> tuple[list[dict], list[bytes] | None]:
    """The image files taken out of the messages, checked (api/images.py); None without images."""
    if not count_images(messages):
        return messages, None
    if not link().model()["vision"]:
        raise RequestError("model has no vision: image inputs are not supported", param="messages",
                           code="model_has_no_vision")
    return take_images(messages, current_app.extensions["moebus.vision"])


@bp.post("/v1/completions")
def completions():
    req = parse_body(CompletionRequest)
    formatter = CompletionFormatter(link().model()["name"], req.logprobs, req.include_usage, req.n)
    logprobs = max(req.logprobs, 1) if req.logprobs is not None else 0
    sampling = req.sampling(req.max_tokens, logprobs)
    constraint = req.constraint()
    streams = _start(formatter, req.n, lambda i, rid: link().client.generate(
        **req.prompt_kwargs(), request_id=rid, constraint=constraint, **req.choice_sampling(sampling, i)))
    return answer(streams, formatter, _client_gone(), req.stream, current_app.extensions["moebus.stopping"])


def _model_card() -> dict:
    model = link().model()
    return {"id": model["name"], "object": "model", "created": 0, "owned_by": "moebus",
            "max_model_len": model["max_context"]}


@bp.get("/v1/models")
def models():
    return {"object": "list", "data": [_model_card()]}


@bp.get("/v1/models/<path:name>")
def model(name: str):
    card = _model_card()
    if name != card["id"]:
        raise NotFound(f"the model {name!r} does not exist (this server serves {card['id']!r})",
                       param="model", code="model_not_found")
    return card
