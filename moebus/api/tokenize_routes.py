"""``POST /tokenize`` and ``POST /detokenize`` as vLLM and llama.cpp's server have them; the broker
holds the tokenizer and the chat template, so both are one round trip to it (TOKENIZE, DETOKENIZE)."""
from __future__ import annotations

from flask import Blueprint

from moebus.api.link import current_link as link
from moebus.api.schemas import DetokenizeRequest, TokenizeRequest, parse_body

bp = Blueprint("tokenize", __name__)


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
