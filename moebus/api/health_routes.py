"""/health: 200 once the broker answers and every worker has loaded its stage, else 503. Open even
when an API key is set (load balancers and probes do not carry one). A healthy service that cannot
serve images (no GPU can make room for the vision worker) says so in ``vision``, still with 200:
text is served."""
from __future__ import annotations

from flask import Blueprint

from moebus.api.errors import error_response
from moebus.api.link import current_link
from moebus.common.errors import MoebusError

bp = Blueprint("health", __name__)


@bp.get("/health")
def health():
    link = current_link()
    if not link.is_ready():
        return error_response(503, "not ready: the model is loading, a worker is restarting, or the broker is down",
                              code="not_ready")
    body = {"status": "ok"}
    try:
        placement = (link.info().get("vision") or {}).get("placement") or {}
    except MoebusError:
        placement = {}  # ready a moment ago: the detail is a bonus, the status stands
    if placement.get("problem"):
        body["vision"] = placement["problem"]
    return body
