"""Tiny ZeroMQ wrappers: make sockets with sane options, send and receive protocol messages."""
from __future__ import annotations

import zmq

from moebus.common import wire
from moebus.common.errors import ConfigError
from moebus.common.protocol import Message

MAX_MESSAGE_BYTES = 1 << 30  # a whole prefill's hidden states fit; anything larger is refused by zmq


def make_socket(ctx: zmq.Context, kind: int, identity: bytes | None = None, max_bytes: int = MAX_MESSAGE_BYTES):
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock


def send(sock, message: Message, identity: bytes | None = None) -> None:
    frames = wire.encode(message)
    sock.send_multipart(([identity] if identity is not None else []) + frames, copy=False)


def recv_frames(sock, routed: bool) -> tuple[bytes | None, list]:
    """(sender identity or None, message frames) without decoding; never blocks if polled first."""
    frames = sock.recv_multipart(copy=False)
    if routed:
        return bytes(frames[0]), [f.buffer for f in frames[1:]]
    return None, [f.buffer for f in frames]


def secure_bind(sock, address: str, public_key: str | None, secret_key: str | None) -> None:
    """Bind; a non-loopback tcp address is served with CURVE (encrypted, the server authenticated)."""
    if not is_loopback(address):
        if not (public_key and secret_key):
            raise ConfigError(f"binding {address} (not loopback) needs broker.curve_public_key and "
                              "broker.curve_secret_key; make a pair with `moebus keys`")
        sock.curve_server = True
        sock.curve_publickey = public_key.encode()
        sock.curve_secretkey = secret_key.encode()
    sock.bind(address)


def secure_connect(sock, address: str, server_key: str | None) -> None:
    """Connect; to a non-loopback tcp address only with CURVE and the broker's public key."""
    if not is_loopback(address):
        if not server_key:
            raise ConfigError(f"connecting to {address} (not loopback) needs broker.curve_public_key "
                              "(the broker's public CURVE key)")
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = server_key.encode()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    sock.connect(address)


def is_loopback(address: str) -> bool:
    """ipc:// and inproc:// are local; tcp:// only on 127.0.0.0/8, localhost or ::1."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
