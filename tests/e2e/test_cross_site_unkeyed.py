"""No cross-site writes on a service without an API key (the default `make serve`): the browser's
simple requests to each state-changing endpoint are refused (see tests/api/test_cross_site.py)."""
from __future__ import annotations

import pytest

from tests.api.test_cross_site import FOREIGN, WRITES, browser_sends


@pytest.mark.parametrize("path", list(WRITES))
@pytest.mark.parametrize("how", ["text/plain", "form", "multipart"])
def test_simple_cross_site_requests_are_refused_without_a_key(service, path, how):
    assert browser_sends(service.base_url, path, how, FOREIGN).status_code == 403
    assert browser_sends(service.base_url, path, how, None).status_code == 415
    assert browser_sends(service.base_url, path, "json", FOREIGN).status_code == 403


def test_the_own_origin_may_write_without_a_key(service):
    r = browser_sends(service.base_url, "/v1/completions", "json", f"http://127.0.0.1:{service.http_port}")
    assert r.status_code == 200 and r.json()["choices"], r.text
