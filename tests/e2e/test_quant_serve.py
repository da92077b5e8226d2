"""`moebus serve` with fp8 experts (MOEBUS_EXPERTS__DTYPE), fp8 attention projections
(MOEBUS_ATTENTION__DTYPE) and an fp8 lm_head (MOEBUS_LM_HEAD__DTYPE): the demo model on two emulated
GPUs, through real clients. /v1/vram counts slots of the fp8 blob, /v1/cache and /metrics say the
dtypes, and the openai SDK gets a completion."""
from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from moebus.common.quant_layout import ExpertLayout
from moebus.cuda.memory.ledger import MIB
from tests.api.helpers import wait_for
from tests.service import Service

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def service(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("quant_serve")
    svc = Service(tmp, demo_model, emulated_vram_mib=[48, 44], emulated_vram_dir=str(tmp / "vram"), max_context=256,
                  env={"MOEBUS_EXPERTS__DTYPE": "fp8", "MOEBUS_ATTENTION__DTYPE": "fp8",
                       "MOEBUS_LM_HEAD__DTYPE": "fp8"})
    try:
        yield svc.wait_ready(timeout_s=180)
    finally:
        assert svc.stop() == []


def _dtype_gauges(service, held="experts") -> dict:
    text = requests.get(service.base_url + "/metrics", timeout=10).text
    return {s.labels["gpu"]: s.labels["dtype"] for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == f"moebus_gpu_{held}_dtype" and s.value == 1}


def test_fp8_experts_fill_the_cache_in_fp8_slots_and_say_so(service):
    slot_bytes = ExpertLayout("fp8", 256, 128).blob_bytes  # the demo model: D 256, I 128
    vram = requests.get(service.base_url + "/v1/vram", timeout=30).json()
    for slots, mib in zip(vram["expert_slots"], vram["expert_cache_mib"]):
        assert slots == int(mib * MIB) // slot_bytes
    # bf16 experts do not all fit in these 48 MiB (tests/e2e/test_vram.py); fp8 ones do (4 x 64 a stage)
    assert vram["expert_slots"][0] >= 4 * 64
    gauges = wait_for(lambda: g if len(g := _dtype_gauges(service)) == 2 else None, timeout_s=30)
    assert gauges == {"0": "fp8", "1": "fp8"}
    cache = requests.get(service.base_url + "/v1/cache", timeout=10).json()
    assert [g["experts_dtype"] for g in cache["gpus"]] == ["fp8", "fp8"]
    assert [g["expert_slot_bytes"] for g in cache["gpus"]] == [slot_bytes, slot_bytes]
    assert [g["attention_dtype"] for g in cache["gpus"]] == ["fp8", "fp8"]
    assert _dtype_gauges(service, "attention") == {"0": "fp8", "1": "fp8"}
    assert [g["lm_head_dtype"] for g in cache["gpus"]] == [None, "fp8"]  # the last stage holds the lm_head
    assert _dtype_gauges(service, "lm_head") == {"1": "fp8"}


def test_openai_completion_with_fp8_experts(service):
    client = openai.OpenAI(base_url=service.base_url + "/v1", api_key="unused")
    out = client.completions.create(model="demo", prompt="The cache holds", max_tokens=8, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 8
