"""Serving one broker request over HTTP: follow its Partials while watching the HTTP client (a client
that has gone cancels the request, streamed or not), and answer whole or as server-sent events."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

from flask import Response, jsonify

from moebus.api.responses import Formatter
from moebus.client import Stream
from moebus.common.errors import RequestError
from moebus.common.protocol import Partial

log = logging.getLogger("moebus.api")
TICK_S = 0.5  # while no token comes: how often to look at the HTTP client
CHECK_S = 0.25  # while tokens come: at most this often


class ClientGone(RequestError):
    """The HTTP client closed its connection (nginx's 499; nobody reads the answer)."""

    http_status = 499
    kind = "client_closed_request"


def has_gone(client_gone) -> bool:
    try:
        return bool(client_gone and client_gone())
    except Exception:  # noqa: BLE001 - a server that cannot tell: assume the client is there
        return False


def follow(stream: Stream, client_gone) -> Iterator[Partial]:
    """The request's Partials; raises ClientGone once the HTTP client has left, RequestError when
    the broker answers an error. However it ends, the request is cancelled unless it finished."""
    checked_s = time.monotonic()
    try:
        while True:
            try:
                part = stream.poll(TICK_S)
            except StopIteration:
                return
            now = time.monotonic()
            if part is None or now - checked_s >= CHECK_S:
                checked_s = now
                if has_gone(client_gone):
                    raise ClientGone("the client closed the connection")
            if part is not None:
                yield part
    finally:
        stream.close()


def answer(stream: Stream, formatter: Formatter, client_gone, as_events: bool) -> Response:
    """Wait for the broker's first answer (so that a rejected request gets its HTTP status), then
    answer in one JSON body or as server-sent events."""
    parts = follow(stream, client_gone)
    first = next(parts, None)  # raises the request's RequestError
    if not as_events:
        collected = ([first] if first is not None else []) + list(parts)
        return jsonify(formatter.body(collected, stream.final))
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return Response(_events(stream, formatter, first, parts), mimetype="text/event-stream", headers=headers)


def sse(data) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _events(stream: Stream, formatter: Formatter, first: Partial | None, parts: Iterator[Partial]):
    try:
        opening = formatter.first_chunk()
        if opening is not None:
            yield sse(opening)
        for part in ([first] if first is not None else []):
            chunk = formatter.chunk(part)
            if chunk is not None:
                yield sse(chunk)
        for part in parts:
            chunk = formatter.chunk(part)
            if chunk is not None:
                yield sse(chunk)
        yield sse(formatter.last_chunk(stream.final))
        if formatter.include_usage:
            yield sse(formatter.usage_chunk(stream.final))
    except ClientGone:
        return
    except RequestError as e:  # the headers are out: the error travels as an event
        yield sse({"error": e.to_dict()})
    except Exception as e:  # noqa: BLE001 - a bug mid-stream still ends the stream properly
        log.exception("streaming failed")
        yield sse({"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error",
                             "param": None, "code": None}})
    finally:
        parts.close()
    yield sse("[DONE]")
