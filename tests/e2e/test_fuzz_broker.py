"""Fuzz a live broker over its real ZeroMQ frontend: hypothesis sends schema-shaped messages (every
client message type, fields of any msgpack type and size, tensor specs that lie) and raw garbage.
Every message gets an answer or is dropped; afterwards the broker is the same process (pid), it
still serves a request, and it holds no request."""
import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moebus.common import protocol as p
from moebus.common import wire
from tests.api.helpers import scrape, wait_for
from tests.common.test_wire_fuzz import specs, values

CLIENT_TYPES = [b"GENERATE", b"CANCEL", b"VRAM", b"INFO", b"PING", b"HEARTBEAT", b"STEP", b"READY", b"FINAL"]
FIELDS = sorted({f for t in CLIENT_TYPES for f in p.MESSAGES[t].model_fields} | {"_tensors"})
LIVE = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

sampling = st.dictionaries(st.sampled_from(sorted(p.Sampling.model_fields)),
                           values | st.integers(-(2 ** 63), 2 ** 64 - 1), max_size=5)
header = st.dictionaries(st.sampled_from(FIELDS), values, max_size=5)


@st.composite
def client_messages(draw):
    msg_type = draw(st.sampled_from(CLIENT_TYPES))
    body = draw(header)
    if msg_type == b"GENERATE" and draw(st.booleans()):  # often enough well-formed to reach admission
        body = {"id": draw(st.text(min_size=1, max_size=8)), "prompt_tokens": draw(st.lists(
            st.integers(-3, 2 ** 33), min_size=1, max_size=6)), "sampling": {**draw(sampling), "max_tokens": 2}}
    if draw(st.booleans()):
        body["_tensors"] = draw(st.dictionaries(st.text(max_size=6), specs, max_size=2))
    frames = [msg_type, msgpack.packb(body, use_bin_type=True)] + draw(st.lists(st.binary(max_size=16), max_size=2))
    return draw(st.sampled_from([frames, frames[:1], [draw(st.binary(max_size=40))] + frames[1:]]))


def test_fuzzing_the_live_broker_leaves_it_serving(service, zmq_client):
    pid = service.proc.pid
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.zmq_address)

    @LIVE
    @given(client_messages())
    def send_one(frames):
        sock.send_multipart(frames)
        while sock.poll(100):  # answers (ERROR, PONG, PARTIAL...) must decode; none may be missing forever
            wire.decode(sock.recv_multipart())

    try:
        send_one()
    finally:
        sock.close()
    assert service.proc.poll() is None and service.proc.pid == pid
    out = zmq_client.generate(prompt="still here", max_tokens=3, temperature=0).collect()
    assert out["completion_tokens"] >= 1
    # the fuzzer's requests all end (generated to max_tokens 2, or cancelled when its socket closed)
    wait_for(lambda: scrape(service.base_url)["moebus_requests_running"] == 0, timeout_s=20)
    assert scrape(service.base_url)["moebus_internal_errors_total"] == 0
