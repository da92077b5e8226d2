"""Shared by the api and e2e tests: read /metrics, wait for a condition, a session with a key (and
a fixture of one), the openai SDK's client."""
from __future__ import annotations

import time
from contextlib import contextmanager

import requests
from prometheus_client.parser import text_string_to_metric_families


def scrape(base_url: str) -> dict[str, float]:
    """Every sample of /metrics by name, labels folded in: ``name{gpu="0"}``."""
    response = requests.get(base_url + "/metrics", timeout=10)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def wait_for(condition, timeout_s: float = 10.0, every_s: float = 0.05):
    """condition()'s first truthy value within timeout_s, else AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {condition}")
        time.sleep(every_s)


@contextmanager
def keyed_session(base_url: str, key: str):
    """A requests session that sends ``key`` as its bearer token; ``session.url(path)`` is the URL."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    session.url = lambda path: base_url + path
    try:
        yield session
    finally:
        session.close()


def keyed_session_fixture(name: str, service: str, key: str, scope: str, doc: str):
    """A fixture ``name`` of ``scope``: a keyed_session to the fixture ``service``'s URL sending ``key``."""
    import pytest

    def session(request):
        with keyed_session(request.getfixturevalue(service).base_url, key) as keyed:
            yield keyed

    session.__doc__ = doc
    return pytest.fixture(scope=scope, name=name)(session)


def openai_sdk(base_url: str, api_key: str = "unused", timeout_s: float = 60, path: str = "/v1"):
    """The openai SDK's client of a service at ``base_url`` + ``path``, without retries (a context
    manager: ``with openai_sdk(service.base_url) as client``)."""
    from openai import OpenAI

    return OpenAI(base_url=base_url + path, api_key=api_key, max_retries=0, timeout=timeout_s)
