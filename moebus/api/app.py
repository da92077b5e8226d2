"""The api's Flask app factory: OpenAI-compatible routes, /v1/vram, /health, /metrics and the dashboard, all of
them answered from the broker through one ZeroMQ client per WSGI worker process. Serve it with a
real WSGI server (moebus.api.server: waitress), never Flask's development server."""
from __future__ import annotations

import threading

from flask import Flask

from moebus.api import dashboard, health_routes, metrics, openai_routes, tokenize_routes, vram_routes
from moebus.api.auth import require_api_key
from moebus.api.cross_site import refuse_cross_site_writes
from moebus.api.errors import register_error_handlers
from moebus.api.link import BrokerLink


def create_app(settings=None) -> Flask:
    """``settings``: a moebus Settings; None reads them from ``MOEBUS_CONFIG`` and the environment."""
    if settings is None:
        from moebus.common.settings import load_settings

        settings = load_settings()
    app = Flask("moebus.api")
    app.config["MAX_CONTENT_LENGTH"] = settings.api.max_body_bytes
    app.json.sort_keys = False
    app.extensions["moebus"] = BrokerLink(settings.broker, settings.max_request_bytes)
    app.extensions["moebus.vision"] = settings.vision  # image limits (api/images.py)
    app.extensions["moebus.stopping"] = threading.Event()  # set on SIGTERM: open streams end with an error

    refuse_cross_site_writes(app, settings.api.host, settings.api.allowed_origins)  # before the key check
    require_api_key(app, settings.api.api_key, settings.api.admin_key)
    register_error_handlers(app)
    for module in (openai_routes, vram_routes, health_routes, metrics, dashboard, tokenize_routes):
        app.register_blueprint(module.bp)
    return app
