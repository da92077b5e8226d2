"""One ``moebus serve`` (the tiny model, no API key, 1024 tokens of context) for the end-to-end tests
that leave it as they found it; tests that kill or stop processes start their own."""
from __future__ import annotations

from contextlib import closing

import pytest

from tests.api.helpers import openai_sdk
from tests.service import Service, running

MAX_REQUEST_BYTES = 1 << 20  # the largest ZeroMQ message the broker takes


@pytest.fixture(scope="package")
def service(tmp_path_factory, tiny_model):
    with running(Service(tmp_path_factory.mktemp("e2e"), tiny_model, max_context=1024,
                         max_request_bytes=MAX_REQUEST_BYTES)) as svc:
        yield svc


@pytest.fixture(scope="package")
def openai_client(service):
    with openai_sdk(service.base_url) as client:
        yield client


@pytest.fixture(scope="package")
def zmq_client(service):
    from moebus.client import Client

    with closing(Client(service.zmq_address, timeout_s=60)) as client:
        yield client


@pytest.fixture(scope="package")
def tokenizer(tiny_model):
    from moebus.common.model_config import load_config
    from moebus.common.tokenizer import TextTokenizer

    return TextTokenizer(tiny_model, load_config(tiny_model).eos_token_ids)
