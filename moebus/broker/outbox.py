"""Every send of the broker loop, on its two ROUTER sockets: to a client (frontend), to a stage's
worker or the vision worker (backend). No send blocks the loop: a peer that cannot take a message
now is treated as gone (a client's requests are cancelled, a stage is lost)."""
from __future__ import annotations

import logging

import zmq

from moebus.broker.stats import Stats
from moebus.broker.worker_pool import WorkerPool
from moebus.common import transport

log = logging.getLogger("moebus.broker")


class Outbox:
    """The Broker's send methods (a mixin: the state is the Broker's, named below)."""

    frontend: zmq.Socket
    backend: zmq.Socket
    pool: WorkerPool
    stats: Stats

    def _reply(self, client: bytes, message) -> bool:
        """Send to a client; False when it cannot take it (gone, or its queue full): then its
        requests fail here rather than wait for replies that would never reach it."""
        try:
            transport.send(self.frontend, message, client, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH (gone) or EAGAIN (not reading)
            self.stats.count("undeliverable_replies_total")
            log.warning("a reply to client %r could not be delivered (%s); its requests are cancelled",
                        client[:16], e.strerror)
            self._drop_client(client)
            return False

    def _send_worker(self, gpu: int, message) -> bool:
        """Send to a worker; False when it is not connected (it is then treated as lost)."""
        try:
            transport.send(self.backend, message, self.pool[gpu].identity, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            log.error("gpu%d cannot be reached (%s)", gpu, e.strerror)
            return False

    def _send_vision(self, message) -> bool:
        """To the vision worker; False while it is not connected (a worker just forked, or gone: the
        lifecycle's heartbeat deadline decides which)."""
        try:
            transport.send(self.backend, message, b"vision", flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False
