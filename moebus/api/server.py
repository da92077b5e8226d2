"""``moebus api``: the Flask app under waitress. Why waitress (see docs/operations.md): its one IO
thread reads every request (headers and body, chunked included) asynchronously and hands it to an
application thread only when it is complete, so slow-header and slow-body clients hold a socket, never
a thread; a size limit is enforced while reading; and the application threads are plain threads, which
the ZeroMQ client needs (no monkey-patching). A streaming request holds one application thread, so
there are enough of them for every request the broker can hold (``max_batch + max_queue``) plus spare
ones that keep /health answering under full load.

``api.workers`` > 1 pre-forks that many waitress processes on one listening socket. SIGTERM ends
every open stream with an error event and the process ``STOP_GRACE_S`` later; a process whose parent
dies is told so by the kernel (SIGTERM) and stops the same way."""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading

from moebus.api.app import create_app
from moebus.common.errors import ConfigError
from moebus.common.parent_death import signal_on_parent_death

log = logging.getLogger("moebus.api")
SPARE_THREADS = 16  # beyond the streams the broker can hold: /health, /metrics, refusals
CHANNEL_TIMEOUT_S = 60  # a connection that sends nothing for this long is closed (slow or idle clients)
STOP_GRACE_S = 1.5  # after SIGTERM: open streams end with an error event within a tick (0.5 s), then exit
HARD_STOP_S = 5.0  # after the grace: a process that has still not exited (a thread that never returns) ends anyway


def app_threads(settings) -> int:
    """``api.threads``, or enough for every request the broker holds plus spare ones."""
    return settings.api.threads or settings.max_batch + settings.max_queue + SPARE_THREADS


def waitress_options(settings) -> dict:
    threads = app_threads(settings)
    return {"threads": threads, "connection_limit": max(1000, 2 * threads), "backlog": 2048,
            "channel_timeout": CHANNEL_TIMEOUT_S, "cleanup_interval": 5,
            # the app answers 413 as an OpenAI error object up to twice the limit; beyond, waitress
            # refuses while reading (plain text) and never buffers more, whatever the transfer encoding
            "max_request_body_size": 2 * settings.api.max_body_bytes,
            "max_request_header_size": 64 * 1024,
            # read one request ahead, so that waitress notices a client that has gone and tells the app
            "channel_request_lookahead": 1, "ident": "moebus", "clear_untrusted_proxy_headers": True}


def listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    return sock


def _serve(settings, sock: socket.socket) -> int:
    from waitress.server import create_server

    app = create_app(settings)
    server = create_server(app, sockets=[sock], **waitress_options(settings))

    def _stop(_signum, _frame):
        # Open streams end with an error event and [DONE], not a cut connection: in `moebus serve` a
        # SIGTERM here means the broker has gone (the parent-death signal). They notice within a
        # tick (api/streaming.py) and waitress writes their last bytes before the process ends.
        log.info("api stopping (signal %d): open streams end now", _signum)
        app.extensions["moebus.stopping"].set()
        signal.signal(signal.SIGALRM, _exit)
        signal.setitimer(signal.ITIMER_REAL, STOP_GRACE_S)
        _exit_anyway_after(STOP_GRACE_S + HARD_STOP_S)

    def _exit(_signum, _frame):
        raise SystemExit(0)  # waitress' run() ends on SystemExit and shuts its threads down

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    try:
        server.run()
    except SystemExit:
        pass
    finally:
        server.close()
    return 0


def _exit_anyway_after(seconds: float) -> None:
    """A stop that has not ended the process within ``seconds`` ends it hard: an api whose broker is
    gone must not outlive it (seen once in the suite: alive 30 s after its serve was killed)."""
    def hard_exit():
        log.warning("api did not stop within %.1f s of the stop signal; exiting now", seconds)
        os._exit(1)

    timer = threading.Timer(seconds, hard_exit)
    timer.daemon = True
    timer.start()


def run_api(settings) -> int:
    """Serve until SIGTERM/SIGINT; the exit status."""
    from moebus.api.auth import check_exposure

    check_exposure(settings.api)
    try:
        sock = listen_socket(settings.api.host, settings.api.port)
    except OSError as e:  # a setting that cannot work: serve ends with it at once (broker/children.py)
        raise ConfigError(f"api.host / api.port {settings.api.host}:{settings.api.port}: {e.strerror or e}") from None
    log.info("api on http://%s:%d (%d threads), broker at %s", settings.api.host, settings.api.port,
             app_threads(settings), settings.broker.frontend)
    if settings.api.workers == 1:
        return _serve(settings, sock)
    return _prefork(settings, sock)


def _prefork(settings, sock: socket.socket) -> int:
    """Several waitress processes accepting on one socket; the parent only waits and forwards SIGTERM."""
    pids = []
    for _ in range(settings.api.workers):
        pid = os.fork()
        if pid == 0:  # the child: no ZeroMQ socket exists yet (the app makes its client on first use)
            signal_on_parent_death(signal.SIGTERM)
            os._exit(_serve(settings, sock))
        pids.append(pid)
    sock.close()

    def _forward(signum, _frame):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    status = 0
    for pid in pids:
        _, code = os.waitpid(pid, 0)
        status = status or os.waitstatus_to_exitcode(code)
    return 0 if status in (0, -signal.SIGTERM) else 1
