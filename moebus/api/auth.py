"""Who may call what. ``Authorization: Bearer <key>`` compared in constant time:

- inference (``/v1/*`` but /v1/vram): ``api.api_key`` when set;
- control (``/v1/vram``): ``api.admin_key``, a different key, so that a leaked inference key cannot
  starve the cache; with an inference key but no admin key, /v1/vram is refused (403);
- ``/health`` and ``/metrics`` stay open (probes and scrapers carry no key), and so does the dashboard
  page (``/``, ``/dashboard``): it asks for the key itself, and its data (``/v1/cache``) needs it.

``check_exposure`` refuses to serve a non-loopback address without an inference key unless
``api.allow_unauthenticated`` says so explicitly."""
from __future__ import annotations

import hmac

from flask import Flask, request

from moebus.common.errors import AuthError, ConfigError, RequestError

OPEN_PATHS = frozenset({"/health", "/metrics", "/", "/dashboard"})  # the page asks for the key itself
ADMIN_PREFIX = "/v1/vram"
LOOPBACK_HOSTS = {"localhost", "::1", "[::1]"}


class Forbidden(RequestError):
    http_status = 403
    kind = "permission_error"


def is_loopback_host(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def check_exposure(api) -> None:
    """Raises ConfigError for an HTTP api that anybody on the network could use without a key."""
    if api.admin_key and api.admin_key == api.api_key:
        raise ConfigError("config keys 'api.admin_key' and 'api.api_key' must differ")
    if not is_loopback_host(api.host) and not api.api_key and not api.allow_unauthenticated:
        raise ConfigError(f"api.host {api.host!r} is not loopback: set api.api_key (and api.admin_key for "
                          "/v1/vram), or api.allow_unauthenticated: true to serve without one")


def _bearer() -> bytes:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return given.strip().encode() if scheme.lower() == "bearer" else b""


def _matches(expected: str) -> bool:
    return hmac.compare_digest(_bearer(), expected.encode())


def require_api_key(app: Flask, api_key: str | None, admin_key: str | None = None) -> None:
    @app.before_request
    def _check_key():
        path = request.path
        if path in OPEN_PATHS:
            return
        if path.startswith(ADMIN_PREFIX):
            if admin_key:
                if not _matches(admin_key):
                    raise AuthError("invalid or missing admin key: /v1/vram needs 'Authorization: Bearer "
                                    "<api.admin_key>'", code="invalid_admin_key")
                return
            if api_key:
                raise Forbidden("/v1/vram is disabled: set api.admin_key to control the VRAM reserves",
                                code="admin_key_not_set")
            return
        if api_key and not _matches(api_key):
            raise AuthError("invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
