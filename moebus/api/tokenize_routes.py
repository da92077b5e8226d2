"""``POST /tokenize`` and ``POST /detokenize`` as vLLM and llama.cpp's server have them; the broker
holds the tokenizer and the chat template, so both are one round trip to it (TOKENIZE, DETOKENIZE)."""
from __future__ import annotations

from typing import Annotated, Any

from flask import Blueprint
from pydantic import Field, model_validator

from moebus.api.link import current_link as link
from moebus.api.schemas import MAX_TOOLS, ChatMessage, Tool, _Body, parse_body, refuse_unknown
from moebus.common.errors import RequestError

bp = Blueprint("tokenize", __name__)


class TokenizeRequest(_Body):
    """``POST /tokenize``: vLLM's two forms (``prompt``, or ``messages`` through the chat template
    with ``tools`` and ``chat_template_kwargs``) and llama.cpp's ``content`` for ``prompt``."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    add_special_tokens: bool = False  # prompts are fed without added special tokens: only false
    add_special: bool = False  # llama.cpp's name of the same

    @model_validator(mode="after")
    def _check(self):
        refuse_unknown(self, {})
        for name in ("add_special_tokens", "add_special"):
            if getattr(self, name):
                raise RequestError(f"{name}: moebus feeds prompts as they tokenize, without added special tokens",
                                   param=name)
        if sum(x is not None for x in (self.prompt, self.content, self.messages)) != 1:
            raise RequestError("give exactly one of prompt, content or messages", param="prompt")
        chat_only = [n for n in ("tools", "chat_template_kwargs", "add_generation_prompt")
                     if n in self.model_fields_set]
        if self.messages is None and chat_only:
            raise RequestError(f"{chat_only[0]} needs messages (it shapes the chat template's rendering)",
                               param=chat_only[0])
        return self

    def broker_kwargs(self) -> dict:
        if self.messages is None:
            return {"prompt": self.prompt if self.prompt is not None else self.content,
                    "token_strs": self.return_token_strs}
        return {"messages": [m.to_broker() for m in self.messages], "token_strs": self.return_token_strs,
                "tools": [t.model_dump(exclude_unset=True) for t in self.tools] if self.tools else None,
                "chat_template_kwargs": self.chat_template_kwargs, "add_generation_prompt": self.add_generation_prompt}


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1 << 20)

    @model_validator(mode="after")
    def _check(self):
        refuse_unknown(self, {})
        return self



@bp.post("/tokenize")
def tokenize():
    req = parse_body(TokenizeRequest)
    reply = link().client.tokenize(**req.broker_kwargs())
    body = {"count": len(reply["tokens"]), "max_model_len": reply["max_context"], "tokens": reply["tokens"]}
    if req.return_token_strs:
        body["token_strs"] = reply["token_strs"]
    return body


@bp.post("/detokenize")
def detokenize():
    req = parse_body(DetokenizeRequest)
    text = link().client.detokenize(req.tokens)
    return {"prompt": text, "content": text}  # vLLM's key and llama.cpp's
