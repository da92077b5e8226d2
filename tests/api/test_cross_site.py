"""No cross-site writes, tested with the requests a browser really sends from another site's page:
"simple" requests (no CORS preflight) with a text/plain, form-encoded or multipart body and that
page's Origin. Each state-changing endpoint refuses them (415 for the body, 403 for the Origin),
whatever key they carry, and the state did not change. This package's service has an API key; the
e2e package's twin (tests/e2e/test_cross_site_unkeyed.py) has none."""
from __future__ import annotations

import json

import pytest
import requests

from tests.api.conftest import ADMIN_KEY, ALLOWED_ORIGIN, API_KEY

FOREIGN = "http://evil.example"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
WRITES = {"/v1/chat/completions": (CHAT, API_KEY), "/v1/completions": ({"prompt": "hi", "max_tokens": 1}, API_KEY),
          "/tokenize": ({"prompt": "hi"}, API_KEY), "/detokenize": ({"tokens": [1, 2]}, API_KEY),
          "/v1/vram": ({"reserve_mib": [7]}, ADMIN_KEY)}


def browser_sends(base_url: str, path: str, how: str, origin: str | None, key: str | None = None,
                  host: str | None = None) -> requests.Response:
    """What a page's ``fetch(url, {method: "POST", mode: "no-cors", body})`` or ``<form>`` submission
    puts on the wire (``Sec-Fetch-*`` as Chrome sends them)."""
    body, _ = WRITES[path]
    headers = {"Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Site": "cross-site"}
    if origin is not None:
        headers["Origin"] = origin
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if host is not None:
        headers["Host"] = host
    url = base_url + path
    if how == "text/plain":
        return requests.post(url, data=json.dumps(body), timeout=30,
                             headers={**headers, "Content-Type": "text/plain;charset=UTF-8"})
    if how == "form":
        return requests.post(url, data={"json": "{}", **{k: str(v) for k, v in body.items()}}, headers=headers,
                             timeout=30)
    if how == "multipart":
        return requests.post(url, files={"file": ("x.json", b"{}", "application/json")}, headers=headers, timeout=30)
    if how == "no body":
        return requests.post(url, headers=headers, timeout=30)
    return requests.post(url, json=body, headers=headers, timeout=30)  # "json": only after a preflight


def vram_reserves(base_url: str) -> list:
    r = requests.get(base_url + "/v1/vram", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["reserve_mib"]


@pytest.mark.parametrize("path", list(WRITES))
@pytest.mark.parametrize("how", ["text/plain", "form", "multipart", "no body"])
@pytest.mark.parametrize("with_key", [False, True])
def test_simple_cross_site_requests_are_refused(service, path, how, with_key):
    key = WRITES[path][1] if with_key else None
    r = browser_sends(service.base_url, path, how, FOREIGN, key)
    assert r.status_code == 403, (r.status_code, r.text)
    assert r.json()["error"]["code"] == "cross_origin_refused"
    r = browser_sends(service.base_url, path, how, None, key)  # a tool without Origin: still no JSON body
    assert r.status_code == 415, (r.status_code, r.text)
    assert r.json()["error"]["code"] == "unsupported_media_type" and "application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", list(WRITES))
def test_a_foreign_origin_is_refused_even_with_a_json_body_and_the_key(service, path):
    r = browser_sends(service.base_url, path, "json", FOREIGN, WRITES[path][1])
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    r = browser_sends(service.base_url, path, "json", "null", WRITES[path][1])  # a sandboxed frame, a file:// page
    assert r.status_code == 403, r.text


def test_a_refused_vram_request_changes_nothing(service):
    before = vram_reserves(service.base_url)
    for how in ("text/plain", "form", "multipart"):
        for origin in (FOREIGN, None):
            assert browser_sends(service.base_url, "/v1/vram", how, origin, ADMIN_KEY).status_code in (403, 415)
    assert browser_sends(service.base_url, "/v1/vram", "json", FOREIGN, ADMIN_KEY).status_code == 403
    assert vram_reserves(service.base_url) == before != [7.0]


def test_own_and_allowed_origins_may_write(service):
    port = service.http_port
    for origin, host in ((f"http://127.0.0.1:{port}", None), (f"http://localhost:{port}", f"localhost:{port}"),
                         (ALLOWED_ORIGIN, None), (ALLOWED_ORIGIN + "/", None)):
        r = browser_sends(service.base_url, "/tokenize", "json", origin, API_KEY, host=host)
        assert r.status_code == 200, (origin, r.text)
    r = browser_sends(service.base_url, "/v1/chat/completions", "json", f"http://127.0.0.1:{port}", API_KEY)
    assert r.status_code == 200 and r.json()["choices"], r.text


def test_a_page_that_rebinds_its_name_to_loopback_is_refused(service):
    """DNS rebinding: the page's own name resolves to 127.0.0.1, so Host and Origin agree, but that
    name is not loopback and the api listens on loopback only."""
    name = f"evil.example:{service.http_port}"
    r = browser_sends(service.base_url, "/tokenize", "json", f"http://{name}", API_KEY, host=name)
    assert r.status_code == 403, r.text


def test_reads_stay_open_to_any_origin_and_say_nothing_to_it(service):
    r = requests.get(service.base_url + "/health", headers={"Origin": FOREIGN}, timeout=30)
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
