"""The live cache page: ``GET /dashboard`` (``/`` redirects there) and the JSON it polls,
``GET /v1/cache``. The page is one HTML document with its CSS and JS inlined from files shipped in
the package (moebus/api/static/), so there is no build step and nothing is fetched from elsewhere;
its Content-Security-Policy admits exactly those inlined pieces and requests to this origin."""
from __future__ import annotations

import base64
import hashlib
from functools import lru_cache
from importlib import resources

from flask import Blueprint, Response, redirect

from moebus.api.dashboard_data import cache_view
from moebus.api.link import current_link

bp = Blueprint("dashboard", __name__)
PAGE_PATHS = ("/", "/dashboard")  # open without the API key: the page holds no data, /v1/cache does


def _asset(name: str) -> str:
    return resources.files("moebus.api").joinpath("static", name).read_text(encoding="utf-8")


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@lru_cache(maxsize=1)
def page() -> tuple[str, str]:
    """(the HTML document, its Content-Security-Policy)."""
    css, js = _asset("dashboard.css"), _asset("dashboard.js")
    html = _asset("dashboard.html").replace("/*CSS*/", css).replace("/*JS*/", js)
    policy = (f"default-src 'none'; style-src {_csp_hash(css)}; script-src {_csp_hash(js)}; "
              "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, policy


@bp.get("/")
def root():
    return redirect("/dashboard", code=302)


@bp.get("/dashboard")
def dashboard():
    html, policy = page()
    return Response(html, mimetype="text/html", headers={"Content-Security-Policy": policy,
                                                         "Cache-Control": "no-cache"})


@bp.get("/v1/cache")
def cache():
    return cache_view(current_link().info())
