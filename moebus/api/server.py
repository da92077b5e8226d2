"""``moebus api``: the Flask app under gunicorn's threaded workers (gthread). SIGTERM stops it
gracefully: the master stops accepting, lets in-flight requests finish for ``GRACEFUL_S``, then
ends its workers. A worker whose master dies is told so by the kernel and stops too."""
from __future__ import annotations

import ctypes
import logging
import signal

from gunicorn.app.base import BaseApplication

from moebus.api.app import create_app

log = logging.getLogger("moebus.api")
GRACEFUL_S = 3  # below the 5 s the broker gives a child between SIGTERM and SIGKILL
PR_SET_PDEATHSIG = 1


def _die_with_master(_server, _worker) -> None:
    """gunicorn's post_fork hook: SIGTERM this worker when its master dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def gunicorn_options(api) -> dict:
    """gunicorn settings from the ``api`` section of the moebus settings."""
    return {"bind": [bind_address(api.host, api.port)], "workers": api.workers, "threads": api.threads,
            "worker_class": "gthread", "graceful_timeout": GRACEFUL_S, "timeout": 120, "keepalive": 5,
            "post_fork": _die_with_master, "proc_name": "moebus-api", "errorlog": "-", "loglevel": "info",
            "accesslog": None, "control_socket_disable": True}


class GunicornServer(BaseApplication):
    def __init__(self, app, options: dict):
        self.application = app
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            if key in self.cfg.settings:  # older gunicorns lack some (control_socket_disable: 25+)
                self.cfg.set(key, value)

    def load(self):
        return self.application


def run_api(settings) -> int:
    """Serve until SIGTERM/SIGINT; the exit status."""
    options = gunicorn_options(settings.api)
    log.info("api on http://%s, broker at %s", options["bind"][0], settings.broker.frontend)
    try:
        GunicornServer(create_app(settings), options).run()
    except SystemExit as e:  # gunicorn's arbiter ends by sys.exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
