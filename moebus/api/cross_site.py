"""No cross-site writes. A web page open in the operator's browser may send "simple" requests to
a service on loopback without any CORS preflight: a POST with a ``text/plain``, form-encoded or
multipart body, or a bodiless one, from any origin. The browser then hides the answer from the page,
but the request has already acted. So every state-changing request (any method but GET, HEAD,
OPTIONS) must

- carry a JSON body (``Content-Type: application/json``): no simple request can, so a page can
  only send one after a preflight that this service never grants (415 otherwise);
- come from no ``Origin`` (curl, SDKs, other servers), from the service's own origin, or from one in
  ``api.allowed_origins`` (403 otherwise). The own origin is the ``Host`` the request was sent to,
  and when the api listens on loopback only a loopback name counts: a page that rebinds its own
  DNS name to 127.0.0.1 sends its own name as Host and Origin, and is refused.

Both hold with and without an API key: they are checked before it."""
from __future__ import annotations

from urllib.parse import urlsplit

from flask import Flask, request

from moebus.api.auth import Forbidden, is_loopback_host
from moebus.api.errors import drain_body
from moebus.common.errors import RequestError

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
JSON_MEDIA_TYPE = "application/json"


class UnsupportedMediaType(RequestError):
    http_status = 415
    kind = "invalid_request_error"


def _host_name(host: str) -> str:
    """``[::1]:8000`` -> ``[::1]``; ``localhost:8000`` -> ``localhost``."""
    return host.rsplit(":", 1)[0] if not host.endswith("]") else host


def is_own_origin(origin: str, host: str, loopback_only: bool) -> bool:
    """``origin`` is ``scheme://host`` of this very request (and, on a loopback-only api, a loopback name)."""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
        return False
    return not loopback_only or is_loopback_host(_host_name(host.lower()))


def is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def refuse_cross_site_writes(app: Flask, api_host: str, allowed_origins: list[str]) -> None:
    """Register the check on ``app``, ahead of the API key check. ``api_host``: the address the api
    listens on (``api.host``)."""
    allowed = {o.rstrip("/") for o in allowed_origins}
    loopback_only = is_loopback_host(api_host)

    @app.before_request
    def _refuse_cross_site():
        if request.method in SAFE_METHODS or request.url_rule is None:
            return  # reads change nothing (and CORS hides their answers); 404 / 405 as they are
        origin = request.headers.get("Origin")
        if origin is not None and origin.rstrip("/") not in allowed and \
                not is_own_origin(origin, request.host, loopback_only):
            drain_body()
            raise Forbidden(f"cross-origin request from {origin[:200]!r} refused: only this service's own "
                            "pages and the origins in api.allowed_origins may send requests that change "
                            "state", code="cross_origin_refused")
        if not is_json(request.content_type):
            drain_body()
            raise UnsupportedMediaType(f"{request.method} {request.path} takes a JSON body: send 'Content-Type: "
                                       f"application/json' (got {(request.content_type or 'none')[:100]!r})",
                                       code="unsupported_media_type")
