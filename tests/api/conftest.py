"""One ``moebus serve`` for every test of the api package: the tiny model, an API key, a small
request-body limit."""
from __future__ import annotations

import pytest

from tests.api.helpers import keyed_session
from tests.service import Service

API_KEY = "test-key"
ADMIN_KEY = "test-admin-key"
MAX_BODY_BYTES = 64 * 1024
ALLOWED_ORIGIN = "http://localhost:3000"  # a page of ours on another port (test_cross_site.py)


@pytest.fixture(scope="package")
def service(tmp_path_factory, tiny_model):
    svc = Service(tmp_path_factory.mktemp("api"), tiny_model,
                  api={"api_key": API_KEY, "admin_key": ADMIN_KEY, "max_body_bytes": MAX_BODY_BYTES,
                       "allowed_origins": [ALLOWED_ORIGIN]})
    try:
        yield svc.wait_ready()
    finally:
        assert svc.stop() == []


@pytest.fixture(scope="package")
def openai_client(service):
    from openai import OpenAI

    with OpenAI(base_url=service.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=30) as client:
        yield client


@pytest.fixture(scope="package")
def http(service):
    """A requests session that sends the API key; ``http.url(path)`` is the service's URL."""
    with keyed_session(service.base_url, API_KEY) as session:
        yield session


@pytest.fixture(scope="package")
def admin(service):
    """A requests session that sends the admin key (for /v1/vram)."""
    with keyed_session(service.base_url, ADMIN_KEY) as session:
        yield session


@pytest.fixture(scope="package")
def tokenizer(tiny_model):
    from moebus.common.model_config import load_config
    from moebus.common.tokenizer import TextTokenizer

    return TextTokenizer(tiny_model, load_config(tiny_model).eos_token_ids)
