"""What a refused request took, it gives back. A hostile client sends prompts of 3 MiB, far over
max_context: each is refused with a 400, the broker does only bounded work before the refusal (its
size, not its tokens), and its resident memory after 24 of them stays within 1.5x of before (it
grew by ~420 MB per prompt and kept it when the whole text was tokenized first)."""
from __future__ import annotations

import random
import string
import time
from pathlib import Path

import pytest

from moebus.client import Client
from moebus.common.errors import RequestError
from tests.service import Service

PROMPT_BYTES = 3 << 20
ROUNDS = 24


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def hostile_prompt(seed: int) -> str:
    """Words of random letters, as a pasted document would tokenize (no one run the BPE merges flat)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 9))) for _ in range(4096)]
    text = " ".join(rng.choices(words, k=PROMPT_BYTES // 5))
    return text[:PROMPT_BYTES]


@pytest.fixture(scope="module")
def broker(tmp_path_factory, tiny_model):
    svc = Service(tmp_path_factory.mktemp("refused"), tiny_model, command="broker")
    try:
        yield svc.wait_ready(http=False)
    finally:
        assert svc.stop() == []


def test_refused_3_mib_prompts_give_their_memory_back(broker):
    client = Client(broker.zmq_address, timeout_s=120)
    prompts = [hostile_prompt(seed) for seed in range(4)]
    try:
        assert len(client.generate(prompt="warm up", max_tokens=2).collect()["tokens"]) == 2
        before = rss_bytes(broker.proc.pid)
        took = []
        for n in range(ROUNDS):
            started = time.monotonic()
            with pytest.raises(RequestError) as err:
                client.generate(prompt=prompts[n % len(prompts)], max_tokens=1).collect()
            took.append(time.monotonic() - started)
            assert err.value.http_status == 400 and err.value.code == "context_length_exceeded"
        after = rss_bytes(broker.proc.pid)
        assert after <= 1.5 * before, f"broker RSS {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after"
        assert max(took) < 5.0, took  # the whole text is never tokenized
        assert len(client.generate(prompt="still here", max_tokens=2).collect()["tokens"]) == 2
    finally:
        client.close()


def test_refused_chats_give_their_memory_back(broker):
    client = Client(broker.zmq_address, timeout_s=120)
    try:
        before = rss_bytes(broker.proc.pid)
        for seed in range(ROUNDS):
            with pytest.raises(RequestError) as err:
                client.chat([{"role": "user", "content": hostile_prompt(seed % 4)}], max_tokens=1).collect()
            assert err.value.http_status == 400 and err.value.code == "context_length_exceeded"
        after = rss_bytes(broker.proc.pid)
        assert after <= 1.5 * before, f"broker RSS {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after"
    finally:
        client.close()


def test_long_tokenizes_do_not_pile_up(broker):
    """A 512 KiB /tokenize is answered (under TOKENIZE's own limit, so all of it is tokenized): what
    each took goes back to the system, so the broker levels off instead of growing with each one."""
    client = Client(broker.zmq_address, timeout_s=120)
    prompts = [hostile_prompt(seed)[: 1 << 19] for seed in range(2)]
    try:
        for prompt in prompts:
            assert len(client.tokenize(prompt=prompt)["tokens"]) > 256
        levelled = rss_bytes(broker.proc.pid)
        for n in range(4):
            assert len(client.tokenize(prompt=prompts[n % 2])["tokens"]) > 256
        after = rss_bytes(broker.proc.pid)
        assert after <= 1.15 * levelled, f"broker RSS {levelled / 2**20:.0f} MiB, then {after / 2**20:.0f} MiB"
    finally:
        client.close()
