"""/v1/vram: report the expert caches (GET) or set per-GPU VRAM reserves (POST). The reply is the
broker's aggregate of the workers' replies, one list entry per GPU in worker order, and its line."""
from __future__ import annotations

from flask import Blueprint

from moebus.api.link import current_link
from moebus.api.schemas import VramRequest, parse_body

bp = Blueprint("vram", __name__)


@bp.get("/v1/vram")
def report():
    return current_link().client.vram(query=True)


@bp.post("/v1/vram")
def reserve():
    req = parse_body(VramRequest)
    return current_link().client.vram(req.reserves, query=req.query)
