"""The layer split: 1, 2 and 3 emulated GPUs give the same greedy tokens and logprobs, equal to
transformers'; a stage can join from elsewhere (another loopback address, or another network
namespace over CURVE), and the broker is ready only when every stage is there."""
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from moebus.client import Client
from tests.models import hf_greedy as transformers_greedy
from tests.service import Service, free_port

PROMPTS = [[5, 17, 99, 3, 42, 7], [200, 11, 12]]
TOKENS = 16


def greedy_through(service: Service) -> list[tuple[list[int], list[float]]]:
    client = Client(service.zmq_address, timeout_s=60)
    try:
        out = []
        for prompt in PROMPTS:
            r = client.generate(prompt_tokens=prompt, max_tokens=TOKENS, temperature=0, ignore_eos=True).collect()
            out.append((r["tokens"], r["logprobs"]))
        return out, client.info()["gpus"]
    finally:
        client.close()


@pytest.fixture(scope="module")
def hf_greedy(tiny_model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return [transformers_greedy(hf, p, TOKENS) for p in PROMPTS]


def test_one_two_three_gpus_agree_with_each_other_and_transformers(tmp_path, tiny_model, hf_greedy):
    results = {}
    for vram in ([64], [32, 32], [24, 16, 16]):
        svc = Service(tmp_path, tiny_model, emulated_vram_mib=vram, command="broker")
        try:
            svc.wait_ready(http=False)
            results[len(vram)], gpus = greedy_through(svc)
            assert [g["layers"] for g in gpus] == {1: [[0, 4]], 2: [[0, 2], [2, 4]], 3: [[0, 2], [2, 3], [3, 4]]}[len(vram)]
        finally:
            assert svc.stop() == []
    for n in (2, 3):
        for (tokens_1, logprobs_1), (tokens_n, logprobs_n) in zip(results[1], results[n]):
            assert tokens_n == tokens_1
            assert np.abs(np.array(logprobs_n) - np.array(logprobs_1)).max() <= 1e-5
    assert [tokens for tokens, _ in results[1]] == hf_greedy


def _worker(config: Path, address: str, prefix=()) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    log = open(config.with_suffix(".log"), "w")
    return subprocess.Popen([*prefix, sys.executable, "-m", "moebus.cli", "worker", "--gpu", "1", "--connect", address,
                             "--config", str(config)], env=env, stdout=log, stderr=subprocess.STDOUT)


def _run_with_remote_stage(tmp_path, tiny_model, backend: str, worker_config: dict, prefix=(), **broker_keys):
    broker = {"backend": backend, "remote_gpus": [1], **broker_keys}
    svc = Service(tmp_path, tiny_model, emulated_vram_mib=[32, 32], emulated_vram_dir=str(tmp_path / "vram"),
                  broker=broker, command="broker")
    worker = None
    try:
        client = Client(svc.zmq_address)
        try:
            assert not client.ping(timeout_s=5.0)  # gpu0 is up soon, but gpu1 has not joined
        finally:
            client.close()
        config = tmp_path / "worker.json"
        config.write_text(json.dumps({**{k: v for k, v in svc.config.items() if k != "broker"},
                                      "broker": worker_config}))
        worker = _worker(config, backend, prefix)
        svc.wait_ready(http=False)
        got, gpus = greedy_through(svc)
        assert [g["layers"] for g in gpus] == [[0, 2], [2, 4]]
        return got
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=10)
        assert svc.stop() == []


def test_stage_on_another_loopback_address(tmp_path, tiny_model, hf_greedy):
    backend = f"tcp://127.0.0.2:{free_port()}"
    got = _run_with_remote_stage(tmp_path, tiny_model, backend, {})
    assert [tokens for tokens, _ in got] == hf_greedy


def _netns_available() -> bool:
    if os.geteuid() != 0:
        return False
    probe = f"mbprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def _free_octet() -> int:
    """A 10.213.X.0/30 that no interface holds: a run killed before its teardown leaves its veth
    behind, and a second address on the host side of another veth makes the broker unreachable."""
    taken = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    start = os.getpid() % 250
    return next(o for o in (1 + (start + i) % 250 for i in range(250)) if f"10.213.{o}.1/" not in taken)


@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair: (namespace, host-side address)."""
    if not _netns_available():
        pytest.skip("network namespaces need root and ip netns")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"mb{tag}", f"mbh{tag}", f"mbn{tag}"
    octet = _free_octet()
    host_ip, ns_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
    steps = [["ip", "netns", "add", ns], ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
             ["ip", "link", "set", ns_if, "netns", ns], ["ip", "addr", "add", f"{host_ip}/30", "dev", host_if],
             ["ip", "link", "set", host_if, "up"],
             ["ip", "-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ns_if], ["ip", "-n", ns, "link", "set", ns_if, "up"],
             ["ip", "-n", ns, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield ns, host_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_stage_in_another_network_namespace_over_curve(tmp_path, tiny_model, hf_greedy, netns):
    import zmq

    ns, host_ip = netns
    public, secret = (k.decode() for k in zmq.curve_keypair())
    worker_public, worker_secret = (k.decode() for k in zmq.curve_keypair())
    backend = f"tcp://{host_ip}:{free_port()}"
    worker_keys = {"curve_public_key": public, "curve_client_public_key": worker_public,
                   "curve_client_secret_key": worker_secret}
    got = _run_with_remote_stage(tmp_path, tiny_model, backend, worker_keys, prefix=("ip", "netns", "exec", ns),
                                 curve_public_key=public, curve_secret_key=secret, curve_client_keys=[worker_public])
    assert [tokens for tokens, _ in got] == hf_greedy


def test_a_worker_whose_key_is_not_allowed_never_joins(tmp_path, tiny_model, netns):
    """CURVE with a ZAP allow-list: knowing the broker's public key is not enough to serve a stage."""
    import zmq

    ns, host_ip = netns
    public, secret = (k.decode() for k in zmq.curve_keypair())
    allowed, _ = (k.decode() for k in zmq.curve_keypair())
    intruder_public, intruder_secret = (k.decode() for k in zmq.curve_keypair())
    backend = f"tcp://{host_ip}:{free_port()}"
    svc = Service(tmp_path, tiny_model, emulated_vram_mib=[32, 32], emulated_vram_dir=str(tmp_path / "vram"),
                  command="broker", broker={"backend": backend, "remote_gpus": [1], "curve_public_key": public,
                                            "curve_secret_key": secret, "curve_client_keys": [allowed]})
    config = tmp_path / "intruder.json"
    config.write_text(json.dumps({**{k: v for k, v in svc.config.items() if k != "broker"},
                                  "broker": {"curve_public_key": public, "curve_client_public_key": intruder_public,
                                             "curve_client_secret_key": intruder_secret}}))
    worker = _worker(config, backend, ("ip", "netns", "exec", ns))
    try:
        with pytest.raises(TimeoutError):
            svc.wait_ready(timeout_s=20, http=False)
    finally:
        worker.terminate()
        worker.wait(timeout=10)
        assert svc.stop() == []


def test_non_loopback_without_keys_is_a_clear_error(tmp_path, tiny_model):
    out = subprocess.run([sys.executable, "-m", "moebus.cli", "worker", "--gpu", "0", "--connect", "tcp://10.9.9.9:5",
                          "--model", str(tiny_model), "--device", "cpu"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MOEBUS_EMULATED_VRAM_DIR": str(tmp_path)})
    assert out.returncode == 2 and "needs broker.curve_public_key" in out.stderr


def test_clients_on_a_non_loopback_frontend_need_an_allowed_key(tmp_path, tiny_model, netns):
    """CURVE + ZAP on the frontend: an allow-listed client is served; one with another key (knowing
    the broker's public key) never gets an answer."""
    import zmq

    _, host_ip = netns
    public, secret = (k.decode() for k in zmq.curve_keypair())
    allowed = tuple(k.decode() for k in zmq.curve_keypair())
    other = tuple(k.decode() for k in zmq.curve_keypair())
    address = f"tcp://{host_ip}:{free_port()}"
    svc = Service(tmp_path, tiny_model, command="broker", broker={
        "frontend": address, "curve_public_key": public, "curve_secret_key": secret, "curve_client_keys": [allowed[0]]})
    good, bad = Client(address, server_key=public, keys=allowed), Client(address, server_key=public, keys=other)
    try:
        deadline = time.monotonic() + 120
        while not good.ping(timeout_s=1.0):
            assert svc.proc.poll() is None and time.monotonic() < deadline, svc.logs()
        assert good.generate(prompt_tokens=[1, 2, 3], max_tokens=2, temperature=0).collect()["completion_tokens"] == 2
        assert not bad.ping(timeout_s=3.0)
    finally:
        good.close()
        bad.close()
        assert svc.stop() == []
