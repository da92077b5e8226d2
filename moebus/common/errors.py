"""Error kinds. Bad requests raise a ``RequestError`` subclass that the edge (HTTP or ZeroMQ) turns
into an error object; anything else is a bug or a broken device and ends the process."""


class MoebusError(Exception):
    """Base of every error that moebus raises on purpose."""


class ConfigError(MoebusError):
    """A setting or a model directory is unusable; the message names the key, file or tensor."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be served: unsupported architecture, missing tensor, shape mismatch."""


class RequestError(MoebusError):
    """A client's request is invalid. ``param`` names the offending field (OpenAI style)."""

    http_status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}


class ServerBusy(RequestError):
    """The admission queue is full (HTTP 503)."""

    http_status = 503
    kind = "server_busy"


class Unavailable(RequestError):
    """The service cannot answer now: still loading, a worker died, or the broker is gone."""

    http_status = 503
    kind = "service_unavailable"


class AuthError(RequestError):
    http_status = 401
    kind = "authentication_error"


class NotFound(RequestError):
    http_status = 404
    kind = "not_found_error"
