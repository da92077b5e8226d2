"""Serving one broker request over HTTP: follow its Partials while watching the HTTP client (a client
that has gone cancels the request, streamed or not), and answer whole or as server-sent events."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterator

from flask import Response, jsonify

from moebus.api.responses import Formatter
from moebus.client import Stream
from moebus.common.errors import RequestError, Unavailable
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


def follow(stream: Stream, client_gone, stopping: threading.Event | None = None) -> Iterator[Partial]:
    """The request's Partials; raises ClientGone once the HTTP client has left, RequestError when
    the broker answers an error, Unavailable once ``stopping`` is set (the api is told to stop: in
    ``moebus serve`` that is the broker's death). However it ends, the request is cancelled unless
    it finished."""
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
                if stopping is not None and stopping.is_set():
                    raise Unavailable("the server is stopping (in moebus serve: the broker has gone)")
            if part is not None:
                yield part
    finally:
        stream.close()


_END = object()


class Drained:
    """A Stream read by a thread of its own into a local queue. The choices of one request are read
    in turn, and one that waits (for the batch, or for the one read before it) must not leave the
    others' replies piling up in the client, which cancels a request past MAX_PENDING_REPLIES
    unread (an n=2 answer longer than that failed). Polled and closed like the Stream."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.local: queue.Queue = queue.Queue()  # at most one request's Partials: bounded by max_tokens
        self.closed = threading.Event()
        threading.Thread(target=self._drain, name=f"drain-{stream.id}", daemon=True).start()

    def _drain(self) -> None:
        try:
            while not self.closed.is_set():
                part = self.stream.poll(TICK_S)
                if part is not None:
                    self.local.put(part)
        except StopIteration:
            self.local.put(_END)
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            self.local.put(e)

    @property
    def final(self):
        return self.stream.final

    def poll(self, wait_s: float) -> Partial | None:
        try:
            item = self.local.get(timeout=wait_s)
        except queue.Empty:
            return None
        if item is _END:
            self.local.put(_END)  # the end stays the end for every later poll
            raise StopIteration
        if isinstance(item, Exception):
            self.local.put(item)
            raise item
        return item

    def close(self) -> None:
        self.closed.set()
        self.stream.close()


def answer(streams: list[Stream], formatter: Formatter, client_gone, as_events: bool,
           stopping: threading.Event | None = None) -> Response:
    """Wait for the broker's first answer to every choice's request (so that a rejected request gets
    its HTTP status), then answer in one JSON body or as server-sent events. ``stopping``: see follow."""
    if len(streams) > 1:
        streams = [Drained(s) for s in streams]
    followers = [follow(s, client_gone, stopping) for s in streams]
    try:
        firsts = [next(f, None) for f in followers]  # raises a request's RequestError
        if not as_events:
            results = [(([first] if first is not None else []) + list(f), s.final)
                       for first, f, s in zip(firsts, followers, streams)]
            return jsonify(formatter.body(results))
    except BaseException:
        _close(streams, followers)
        raise
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return Response(_events(streams, formatter, firsts, followers), mimetype="text/event-stream", headers=headers)


def _close(streams: list[Stream], followers: list) -> None:
    for follower in followers:
        follower.close()
    for stream in streams:  # a follower that never started has no finally to run
        stream.close()


def _merged(firsts: list, followers: list) -> Iterator[tuple[int, Partial | None]]:
    """(choice, Partial) as they come, and (choice, None) once that choice's request has finished.
    The choices decode in the same steps, so taking one Partial of each in turn keeps them even."""
    for i, first in enumerate(firsts):
        yield i, first
    active = [i for i, first in enumerate(firsts) if first is not None]
    while active:
        for i in list(active):
            part = next(followers[i], None)
            if part is None:
                active.remove(i)
            yield i, part


def sse(data) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _events(streams: list[Stream], formatter: Formatter, firsts: list, followers: list):
    try:
        for opening in formatter.first_chunks():
            yield sse(opening)
        for index, part in _merged(firsts, followers):
            if part is None:
                chunk = formatter.last_chunk(index, streams[index].final)
            else:
                chunk = formatter.chunk(index, part)
            if chunk is not None:
                yield sse(chunk)
        if formatter.include_usage:
            yield sse(formatter.usage_chunk([s.final for s in streams]))
    except ClientGone:
        return
    except RequestError as e:  # the headers are out: the error travels as an event
        yield sse({"error": e.to_dict()})
    except Exception as e:  # noqa: BLE001 - a bug mid-stream still ends the stream properly
        log.exception("streaming failed")
        yield sse({"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error",
                             "param": None, "code": None}})
    finally:
        _close(streams, followers)
    yield sse("[DONE]")
