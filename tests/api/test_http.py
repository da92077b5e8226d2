"""The HTTP edge: API key, body limit, /v1/models, /health, /metrics, /v1/vram."""
import requests

from tests.api.conftest import API_KEY, MAX_BODY_BYTES
from tests.api.helpers import scrape, wait_for

USER = [{"role": "user", "content": "hi"}]


def test_api_key_is_required_except_on_health_and_metrics(service):
    url = service.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": "Basic x"}):
        r = requests.post(url + "/v1/chat/completions", json={"messages": USER}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert requests.get(url + "/v1/models", headers=headers).status_code == 401
    assert requests.get(url + "/health").status_code == 200
    assert requests.get(url + "/metrics").status_code == 200
    ok = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_sdk_with_a_wrong_key(service):
    import openai

    client = openai.OpenAI(base_url=service.base_url + "/v1", api_key="wrong", max_retries=0)
    try:
        client.models.list()
        raise AssertionError("no error")
    except openai.AuthenticationError as e:
        assert e.status_code == 401


def test_body_limit(http):
    big = {"messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}
    r = http.post(http.url("/v1/chat/completions"), json=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert http.post(http.url("/v1/chat/completions"), json={"messages": USER, "max_tokens": 1}).status_code == 200


def test_models(openai_client, tiny_model):
    models = openai_client.models.list().data
    assert [m.id for m in models] == [tiny_model.name]
    assert openai_client.models.retrieve(tiny_model.name).id == tiny_model.name


def test_health(service):
    r = requests.get(service.base_url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics_follow_requests(service, http):
    before = scrape(service.base_url)
    r = http.post(http.url("/v1/completions"), json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                                                     "ignore_eos": True})
    assert r.status_code == 200
    after = scrape(service.base_url)
    assert after["moebus_requests_running"] == 0 and after["moebus_requests_waiting"] == 0
    assert after["moebus_prompt_tokens_total"] - before["moebus_prompt_tokens_total"] == 3
    assert after["moebus_generation_tokens_total"] - before["moebus_generation_tokens_total"] == 4
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert after[f"moebus_{name}_count"] >= before.get(f"moebus_{name}_count", 0) + 1
        assert after[f'moebus_{name}_bucket{{le="+Inf"}}'] == after[f"moebus_{name}_count"]
    assert after['moebus_gpu_ready{gpu="0"}'] == 1


def test_per_gpu_metrics_from_the_workers(service):
    """The workers' expert-cache figures reach /metrics (the broker asks them every few seconds)."""
    def with_cache_figures():
        m = scrape(service.base_url)
        return m if 'moebus_expert_cache_hits_total{gpu="0"}' in m else None

    metrics = wait_for(with_cache_figures, timeout_s=10)
    gpus = [k for k in metrics if k.startswith("moebus_gpu_expert_slots{")]
    assert gpus and metrics["moebus_expert_slots"] == sum(metrics[k] for k in gpus)
    for name in ("gpu_expert_cache_mib", "gpu_free_mib", "gpu_reserve_mib", "expert_cache_misses_total",
                 "expert_h2d_bytes_total"):
        assert f'moebus_{name}{{gpu="0"}}' in metrics
    assert "moebus_expert_cache_mib" in metrics


def test_metrics_content_type(service):
    r = requests.get(service.base_url + "/metrics")
    assert r.headers["Content-Type"].startswith("text/plain")
    assert "# TYPE moebus_e2e_request_latency_seconds histogram" in r.text


def test_vram_takes_the_admin_key_not_the_inference_key(http, admin):
    for session, status in ((http, 401), (admin, 200)):
        assert session.get(session.url("/v1/vram")).status_code == status
    assert admin.post(admin.url("/v1/chat/completions"), json={"messages": USER}).status_code == 401


def test_vram_report_and_errors(admin):
    http = admin
    r = http.get(http.url("/v1/vram"))
    body = r.json()
    if r.status_code == 200:  # the workers' elastic cache answers
        assert set(body) >= {"reserve_mib", "free_mib", "expert_slots", "expert_cache_mib", "line"}
        assert len(body["expert_slots"]) == len(body["free_mib"]) >= 1 and body["line"].startswith("reserve_mib=")
    else:  # not built yet: the broker's error, as an OpenAI error object with its status
        assert set(body["error"]) == {"message", "type", "param", "code"}
    for bad in ({"reserve_mib": "lots"}, {"reserve_mib": [-1]}, {"reserve_mib": [1] * 99}, {"reserve_mib": [True]},
                {"query": "yes"}):
        err = http.post(http.url("/v1/vram"), json=bad)
        assert err.status_code == 400, (bad, err.text)
        assert err.json()["error"]["param"].startswith(next(iter(bad)))


def test_vram_reserve_and_back(admin):
    http = admin
    reserved = http.post(http.url("/v1/vram"), json={"reserve_mib": [8]})
    bare = http.post(http.url("/v1/vram"), json={})
    for r in (reserved, bare):
        assert r.status_code in (200, 400), r.text
        if r.status_code == 200:
            assert r.json()["line"].startswith("reserve_mib=")
    if reserved.status_code == 200:
        assert reserved.json()["reserve_mib"][0] == 8  # the other GPUs keep their start-up reserve
