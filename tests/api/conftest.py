"""One ``moebus serve`` for every test of the api package: the tiny model, an API key, a small
request-body limit; and transformers' tokenizer for the modules that serve a ``model_dir`` of their own."""
from __future__ import annotations

import pytest

from tests.api.helpers import keyed_session_fixture, openai_sdk
from tests.service import Service, running

API_KEY = "test-key"
ADMIN_KEY = "test-admin-key"
MAX_BODY_BYTES = 64 * 1024
ALLOWED_ORIGIN = "http://localhost:3000"  # a page of ours on another port (test_cross_site.py)


@pytest.fixture(scope="package")
def service(tmp_path_factory, tiny_model):
    with running(Service(tmp_path_factory.mktemp("api"), tiny_model,
                         api={"api_key": API_KEY, "admin_key": ADMIN_KEY, "max_body_bytes": MAX_BODY_BYTES,
                              "allowed_origins": [ALLOWED_ORIGIN]})) as svc:
        yield svc


@pytest.fixture(scope="package")
def openai_client(service):
    with openai_sdk(service.base_url, API_KEY, timeout_s=30) as client:
        yield client


http = keyed_session_fixture("http", "service", API_KEY, "package",
                             "A requests session that sends the API key; ``http.url(path)`` is the service's URL.")
admin = keyed_session_fixture("admin", "service", ADMIN_KEY, "package",
                              "A requests session that sends the admin key (for /v1/vram).")


@pytest.fixture(scope="package")
def tokenizer(tiny_model):
    from moebus.common.model_config import load_config
    from moebus.common.tokenizer import TextTokenizer

    return TextTokenizer(tiny_model, load_config(tiny_model).eos_token_ids)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    """transformers' tokenizer of the module's own ``model_dir`` (a module that serves a model of its own)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)
