"""What ``make serve`` runs on a fresh clone: ``moebus serve`` without a model serves the embedded
demo model, made on first use into MOEBUS_CACHE_DIR (a fresh directory here)."""
import openai

from tests.service import Service


def test_serve_without_a_model_answers_a_chat(tmp_path):
    svc = Service(tmp_path, None, env={"MOEBUS_CACHE_DIR": str(tmp_path / "cache")})
    try:
        svc.wait_ready(timeout_s=180)
        client = openai.OpenAI(base_url=svc.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                             max_tokens=8)
        assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
        assert (tmp_path / "cache" / model / "config.json").is_file()
        client.close()
    finally:
        assert svc.stop() == []
