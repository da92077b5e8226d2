"""/health: 200 once the broker answers and every worker has loaded its stage, else 503. Open even
when an API key is set (load balancers and probes do not carry one)."""
from __future__ import annotations

from flask import Blueprint

from moebus.api.errors import error_response
from moebus.api.link import current_link

bp = Blueprint("health", __name__)


@bp.get("/health")
def health():
    if current_link().is_ready():
        return {"status": "ok"}
    return error_response(503, "not ready: the model is loading, a worker is restarting, or the broker is down",
                          code="not_ready")
