"""The VRAM command end to end on the cpu device with two emulated GPUs: a second process can
only allocate what the caches really handed back; ZeroMQ, CLI and HTTP paths; /metrics equals
every reply; greedy output does not change with the cache size."""
import json
import subprocess
import sys

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from moebus.client import Client
from moebus.common.errors import RequestError
from tests.service import Service

ALLOCATE = """
import sys
from moebus.cuda.memory.ledger import EmulatedGpu, OutOfMemory
try:
    EmulatedGpu(sys.argv[1]).allocate(int(float(sys.argv[2]) * 2 ** 20), "vision")
    print("ok")
except OutOfMemory as e:
    print("oom")
"""


def helper_allocates(ledger, mib: float) -> bool:
    """Another process asks the emulated GPU for ``mib`` (and frees it when it exits)."""
    out = subprocess.run([sys.executable, "-c", ALLOCATE, str(ledger), str(mib)], capture_output=True, text=True)
    assert out.stdout.strip() in ("ok", "oom"), out.stderr
    return out.stdout.strip() == "ok"


@pytest.fixture(scope="module")
def service(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("vram")
    svc = Service(tmp, demo_model, emulated_vram_mib=[48, 44], emulated_vram_dir=str(tmp / "vram"),
                  segment_mib=2, max_context=512)
    svc.vram_dir = tmp / "vram"
    try:
        yield svc.wait_ready(timeout_s=180)
    finally:
        assert svc.stop() == []


@pytest.fixture(scope="module")
def client(service):
    c = Client(service.zmq_address, timeout_s=60)
    yield c
    c.close()


def metrics(service) -> dict:
    text = requests.get(service.base_url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("{gpu=%s}" % sample.labels["gpu"] if "gpu" in sample.labels else "")
            out[key] = sample.value
    return out


def assert_metrics_match(service, reply: dict) -> None:
    m = metrics(service)
    assert m["moebus_expert_slots"] == sum(reply["expert_slots"])
    assert m["moebus_expert_cache_mib"] == pytest.approx(sum(reply["expert_cache_mib"]))
    for gpu, _ in enumerate(reply["expert_slots"]):
        for name in ("expert_slots", "expert_cache_mib", "free_mib", "reserve_mib"):
            assert m[f"moebus_gpu_{name}{{gpu={gpu}}}"] == pytest.approx(reply[name][gpu]), name


def test_released_memory_is_really_free_for_another_process(service, client):
    start = client.vram(query=True)
    assert len(start["expert_slots"]) == 2 and start["line"].startswith("reserve_mib=0,0 ")
    assert start["expert_slots"][0] < 4 * 64  # four layers of 64 experts: not all fit
    assert_metrics_match(service, start)
    want = start["free_mib"][0] + 7  # more than is free now, less than one segment more: rounds up
    assert not helper_allocates(service.vram_dir / "gpu0", want)
    reply = client.vram([want])
    assert reply["free_mib"][0] >= want and reply["expert_slots"][0] < start["expert_slots"][0]
    assert reply["expert_slots"][1] == start["expert_slots"][1]  # a missing value: gpu1 as it started
    assert_metrics_match(service, reply)
    assert helper_allocates(service.vram_dir / "gpu0", want)
    bare = client.vram()
    assert bare["expert_slots"] == start["expert_slots"] and bare["expert_cache_mib"] == start["expert_cache_mib"]
    assert_metrics_match(service, bare)
    assert not helper_allocates(service.vram_dir / "gpu0", want)


def test_greedy_output_does_not_depend_on_the_cache_size(client):
    def run():
        r = client.generate(prompt="the expert cache shrinks and grows", max_tokens=24, temperature=0,
                            ignore_eos=True).collect()
        return r["tokens"], r["logprobs"]

    full = run()
    client.vram([30, 28])
    small = run()
    client.vram()
    assert small == full


def test_cli_path(service):
    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "moebus.cli", "vram", *args, "--connect", service.zmq_address],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    reply = json.loads(cli("20", "25", "--json"))
    assert reply["reserve_mib"] == [20, 25] and all(f >= r for f, r in zip(reply["free_mib"], [20, 25]))
    assert_metrics_match(service, reply)
    line = cli()
    assert line.startswith("reserve_mib=0,0 free_mib=") and "expert_slots=" in line
    bad = subprocess.run([sys.executable, "-m", "moebus.cli", "vram", "1", "2", "3", "--connect",
                          service.zmq_address], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "3 reserves given for 2 GPU(s)" in bad.stderr


def test_http_path_and_bad_values_change_nothing(service):
    url = service.base_url + "/v1/vram"
    before = requests.get(url, timeout=30).json()
    for bad in ({"reserve_mib": [-1]}, {"reserve_mib": ["x"]}, {"reserve_mib": [1, 2, 3]}, {"reserve_mib": "10"},
                {"reserve_mib": [float("1e400")]}):
        r = requests.post(url, data=json.dumps(bad), headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert requests.get(url, timeout=30).json() == before
    shrunk = requests.post(url, json={"reserve_mib": [30, 25]}, timeout=30).json()
    assert shrunk["reserve_mib"] == [30, 25] and shrunk["line"].startswith("reserve_mib=30,25 ")
    assert_metrics_match(service, shrunk)
    back = requests.post(url, json={}, timeout=30).json()
    assert back["expert_slots"] == before["expert_slots"]
    assert_metrics_match(service, back)


def test_zeromq_bad_values(client):
    for bad in ([-5], [1, 2, 3]):
        with pytest.raises(RequestError, match="reserve"):
            client.vram(bad)


def test_a_fixed_size_cache_refuses_vram_requests(tmp_path, tiny_model):
    svc = Service(tmp_path, tiny_model, vram_elastic=False, command="broker")
    try:
        svc.wait_ready(http=False)
        c = Client(svc.zmq_address, timeout_s=60)
        try:
            report = c.vram(query=True)
            with pytest.raises(RequestError, match="not elastic"):
                c.vram([1])
            assert c.vram(query=True) == report
        finally:
            c.close()
    finally:
        assert svc.stop() == []
