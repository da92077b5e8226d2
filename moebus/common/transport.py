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


MORE = int(zmq.SNDMORE)  # a plain int: pyzmq's Flag enum costs about a microsecond per `|`


def send(sock, message: Message, identity: bytes | None = None, flags: int = 0) -> None:
    frames = wire.encode(message)
    send_frames(sock, ([identity] if identity is not None else []) + frames, flags)


def send_frames(sock, frames: list, flags: int = 0) -> None:
    """send_multipart(frames, copy=False) without its per-frame enum arithmetic (a decode STEP is
    ten frames; this halves what sending them costs). Atomic as a multipart message always is:
    ZeroMQ takes all the parts once it took the first."""
    last = int(flags)
    more = MORE | last
    for frame in frames[:-1]:
        sock.send(frame, more, copy=False)
    sock.send(frames[-1], last, copy=False)


def recv_all(sock) -> list:
    """recv_multipart(copy=False), reading each frame's ``more`` instead of asking the socket for
    RCVMORE after every part."""
    frames = [sock.recv(copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    return frames


def recv_frames(sock, routed: bool) -> tuple[bytes | None, list]:
    """(sender identity or None, message frames) without decoding; never blocks if polled first."""
    frames = recv_all(sock)
    if routed:
        return bytes(frames[0]), [f.buffer for f in frames[1:]]
    return None, [f.buffer for f in frames]


def secure_bind(sock, address: str, public_key: str | None, secret_key: str | None,
                allowed_keys: list[str] | None = None) -> None:
    """Bind; a non-loopback tcp address is served with CURVE (encrypted, the server authenticated)
    and, given ``allowed_keys``, only to peers whose public key is in that list (ZAP)."""
    if not is_loopback(address):
        if not (public_key and secret_key):
            raise ConfigError(f"binding {address} (not loopback) needs broker.curve_public_key and "
                              "broker.curve_secret_key; make a pair with `moebus keys`")
        if allowed_keys is not None:
            if not allowed_keys:
                raise ConfigError(f"binding {address} (not loopback) needs broker.curve_client_keys: the "
                                  "public keys of the clients and workers allowed in (`moebus keys` makes pairs)")
            start_authenticator(sock.context, allowed_keys)
        sock.curve_server = True
        sock.curve_publickey = public_key.encode()
        sock.curve_secretkey = secret_key.encode()
    sock.bind(address)


_authenticators: dict = {}


class _AllowList:
    """ZAP credentials provider: a CURVE peer gets in when its public key is listed."""

    def __init__(self, keys: list[str]):
        self.keys = {k.encode() if isinstance(k, str) else k for k in keys}

    def callback(self, _domain, key: bytes) -> bool:
        import zmq.utils.z85 as z85

        return z85.encode(key) in self.keys or key in self.keys


def start_authenticator(ctx, allowed_keys: list[str]) -> None:
    """One ZAP handler per context (it serves every CURVE socket of the process), in its own thread
    with its own socket."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = _authenticators.get(id(ctx))
    if auth is None:
        auth = _authenticators[id(ctx)] = ThreadAuthenticator(ctx)
        auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(allowed_keys))


def stop_authenticators() -> None:
    for auth in _authenticators.values():
        auth.stop()
    _authenticators.clear()


def secure_connect(sock, address: str, server_key: str | None, keys: tuple[str, str] | None = None,
                   curve: bool | None = None) -> None:
    """Connect; to a non-loopback tcp address only with CURVE and the broker's public key. ``keys``:
    this peer's own (public, secret) pair, which a broker with an allow-list must know; without
    it a throw-away pair is made. ``curve``: force it on (a loopback connection to a broker that
    binds a wildcard address, which serves CURVE on every interface) or off; None: by address."""
    if curve if curve is not None else not is_loopback(address):
        if not server_key:
            raise ConfigError(f"connecting to {address} (not loopback) needs broker.curve_public_key "
                              "(the broker's public CURVE key)")
        public, secret = (keys[0].encode(), keys[1].encode()) if keys and keys[0] else zmq.curve_keypair()
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


def client_keys(broker) -> tuple[str, str] | None:
    """This process's own CURVE pair from the broker settings section, when both halves are set."""
    pair = broker.curve_client_public_key, broker.curve_client_secret_key
    return pair if all(pair) else None
