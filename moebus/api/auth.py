"""Optional API key: ``Authorization: Bearer <key>`` on every path but /health, /metrics and the
dashboard page (its data, /v1/cache, needs the key), compared in constant time."""
from __future__ import annotations

import hmac

from flask import Flask, request

from moebus.common.errors import AuthError

OPEN_PATHS = frozenset({"/health", "/metrics", "/", "/dashboard"})  # the page asks for the key itself


def require_api_key(app: Flask, api_key: str | None) -> None:
    if not api_key:
        return
    expected = api_key.encode()

    @app.before_request
    def _check_key():
        if request.path in OPEN_PATHS:
            return
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise AuthError("invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
