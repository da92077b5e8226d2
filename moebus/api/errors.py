"""Every error the api answers is an OpenAI error object, ``{"error": {"message", "type", "param",
"code"}}``, with the HTTP status of its kind: RequestErrors (ours and the broker's, which carry
their status), Werkzeug's HTTP errors (404, 405, 413, ...) and anything unexpected (500)."""
from __future__ import annotations

import logging

from flask import Flask, jsonify, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from moebus.common.errors import RequestError

log = logging.getLogger("moebus.api")

HTTP_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
              429: "rate_limit_error", 503: "service_unavailable"}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
MAX_DRAIN_BYTES = 8 << 20


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str | None = None, param: str | None = None,
                   code: str | None = None):
    kind = kind or HTTP_KINDS.get(status, "server_error")
    return jsonify(error_body(message, kind, param, code)), status


def request_error_body(err: RequestError) -> dict:
    return {"error": err.to_dict()}


def param_of(loc: tuple) -> str | None:
    """A pydantic error location as an OpenAI ``param`` (``messages.0.role``), without the tags that
    pydantic adds for union members (``str``, ``list[int]``, ``function-after[...]``)."""
    names = [str(p) for p in loc if isinstance(p, int) or ("[" not in p and p not in _UNION_TAGS)]
    return ".".join(names) or None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def from_validation_error(err: ValidationError) -> RequestError:
    first = err.errors()[0]
    param = param_of(first["loc"])
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return RequestError(message, param=param)


def drain_body(max_bytes: int = MAX_DRAIN_BYTES) -> None:
    """Read what the client still sends of a refused body: closing with unread data resets the
    connection, and the client would see that instead of the refusal (413, 415, 403)."""
    stream = request.environ.get("wsgi.input")
    try:
        while max_bytes > 0 and stream is not None:
            chunk = stream.read(min(max_bytes, 1 << 16))
            if not chunk:
                return
            max_bytes -= len(chunk)
    except (OSError, ValueError):
        return


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(RequestError)
    def _request_error(err: RequestError):
        return jsonify(request_error_body(err)), err.http_status

    @app.errorhandler(ValidationError)
    def _validation_error(err: ValidationError):
        return _request_error(from_validation_error(err))

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        status = err.code or 500
        message = err.description
        if status == 413:
            message = f"the request body exceeds {app.config['MAX_CONTENT_LENGTH']} bytes (api.max_body_bytes)"
            drain_body()
        return error_response(status, message, code=HTTP_CODES.get(status))

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(err).__name__}", "server_error")
