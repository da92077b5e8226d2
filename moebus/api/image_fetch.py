"""GET of an http(s) image URL that lies under one of ``vision.allowed_url_prefixes``, within
``vision.fetch_deadline_s`` all told. A per-read timeout alone (``vision.fetch_timeout_s``) would let
a server that trickles a byte every few seconds, in its headers or its body, hold the request
forever: every read succeeds in time. So a watchdog shuts the connection's socket down at the
deadline, which wakes whatever read is blocked on it, and the fetch then fails. Built on
http.client, which hands over its socket before the request is sent (requests hides it until the
headers are in): no redirect is followed (one could lead outside the prefixes), no proxy is used,
and https is verified against the system's certificate store."""
from __future__ import annotations

import http.client
import socket
import ssl
import threading
import urllib.parse

from moebus.common.errors import RequestError
from moebus.common.images import ImageLimits, check_bytes

READ_BYTES = 1 << 16


class _Watchdog:
    """Shuts the fetch's socket down ``deadline_s`` after it was made, unless ``disarm``ed first. It
    keeps a file of the socket open until then: http.client drops its own references as it likes
    (an HTTP/1.0 answer passes the socket to the response; the body's end closes it), and the
    descriptor must not be closed, and perhaps reused by another socket, before the shutdown."""

    def __init__(self, deadline_s: float):
        self.lock, self.sock, self.hold, self.fired, self.done = threading.Lock(), None, None, False, False
        self.timer = threading.Timer(deadline_s, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self.lock:
            self.sock, self.hold = sock, sock.makefile("rb")
            if self.fired:  # the connect itself took the whole deadline
                self._shutdown()

    def _fire(self) -> None:
        with self.lock:
            self.fired = True
            if not self.done and self.sock is not None:
                self._shutdown()

    def _shutdown(self) -> None:
        try:  # the plain socket's shutdown, below any TLS layer: it wakes a read blocked in either
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass  # the peer closed it already

    def disarm(self) -> None:
        self.timer.cancel()
        with self.lock:
            self.done = True
            if self.hold is not None:
                self.hold.close()


def _failed(where: str, why: str) -> RequestError:
    return RequestError(f"{where}: fetching the image failed ({why})", param=where, code="image_fetch_failed")


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout_s,
                                           context=ssl.create_default_context()), target
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s), target


def _body(response: http.client.HTTPResponse, limits: ImageLimits, where: str) -> bytes:
    data = bytearray()
    while chunk := response.read1(READ_BYTES):  # one socket read each: the size limit applies as bytes come
        data += chunk
        if len(data) > limits.max_bytes:
            check_bytes(len(data), limits, where)
    if response.length:  # the connection ended before Content-Length bytes came
        raise _failed(where, "the body ended early")
    return bytes(data)


def fetch(url: str, limits: ImageLimits, where: str, timeout_s: float, deadline_s: float) -> bytes:
    """The file at ``url`` (already checked against the allowed prefixes, as it will be sent);
    RequestError ``image_fetch_failed`` (400) when it cannot be had within ``deadline_s``, or
    ImageTooLarge (413) past ``vision.max_image_bytes``."""
    try:
        conn, target = _connection(url, min(timeout_s, deadline_s))
    except (ValueError, http.client.HTTPException):
        raise _failed(where, "not a URL it can fetch") from None
    watchdog, response = _Watchdog(deadline_s), None
    try:
        conn.connect()
        watchdog.watch(conn.sock)
        conn.request("GET", target, headers={"User-Agent": "moebus", "Accept": "image/*"})
        response = conn.getresponse()
        if response.status != 200:
            raise RequestError(f"{where}: fetching the image answered HTTP {response.status}", param=where,
                               code="image_fetch_failed")
        data = _body(response, limits, where)
    except (OSError, http.client.HTTPException, ValueError, RequestError) as e:  # ssl errors, timeouts: OSError
        error = e
    else:
        error = None
    finally:
        watchdog.disarm()
        if response is not None:  # an HTTP/1.0 answer holds the socket, not the connection
            response.close()
        conn.close()
    if watchdog.fired:  # whatever the shutdown made of the read: an error, or a body ended in silence
        raise _failed(where, f"not done within vision.fetch_deadline_s, {deadline_s:g} s")
    if isinstance(error, RequestError):
        raise error
    if error is not None:
        raise _failed(where, type(error).__name__)
    return data
