"""Tiny ZeroMQ wrappers: make sockets with sane options, send and receive protocol messages."""
from __future__ import annotations

import zmq

from moebus.common import wire
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


def is_loopback(address: str) -> bool:
    """ipc:// and inproc:// are local; tcp:// only on 127.0.0.0/8, localhost or ::1."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
