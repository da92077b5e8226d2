"""The loop every worker process shares: recv -> handle -> reply until SHUTDOWN. Heartbeats and
reconnects live in BrokerLink (as in zguide's mdwrkapi), so a worker's body is just its handlers."""
from __future__ import annotations

import logging

from moebus.common.protocol import Shutdown
from moebus.cuda.backends import is_fatal_device_error

log = logging.getLogger("moebus.worker")
FATAL_EXIT_STATUS = 3  # a poisoned CUDA context must not keep serving errors: the process ends


def serve(link, handle, failure) -> int:
    """Answer every message with ``handle(message)``; a message that raises is answered with
    ``failure(message, text, fatal)`` instead. Returns the process exit status."""
    while True:
        message = link.recv(timeout_s=1.0)
        if message is None:
            continue
        if isinstance(message, Shutdown):
            return 0
        try:
            link.send(handle(message))
        except Exception as e:  # noqa: BLE001 - every failure is reported to the broker
            fatal = is_fatal_device_error(e)
            log.exception("%s failed%s", type(message).__name__, " (fatal device error, exiting)" if fatal else "")
            link.send(failure(message, f"{type(e).__name__}: {str(e)[:1000]}", fatal))
            if fatal:
                return FATAL_EXIT_STATUS
