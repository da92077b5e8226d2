"""An on/off switch or a number in the environment (``MOEBUS_…``), read where the part it sets is made."""
from __future__ import annotations

import os

from moebus.common.errors import ConfigError


def switch_from_env(name: str, environ=os.environ, default: bool = False) -> bool:
    """``name`` as 0 or 1 (unset: ``default``), else a ConfigError naming it."""
    text = environ.get(name, "1" if default else "0")
    if text not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


AT_LEAST_0 = (lambda value: 0 <= value < float("inf"), ">= 0")  # (nan and inf fail the test)


def number_from_env(name: str, default: str, meaning: str, environ=os.environ, within=AT_LEAST_0) -> float:
    """The environment variable ``name`` (``default`` where unset) as a number that passes ``within``'s
    test (default: finite and >= 0), else a ConfigError naming it, the range (``within``'s words) and
    what it is (``meaning``), raised where it is read (a worker's or the broker's start), not at import."""
    test, words = within
    text = environ.get(name, default)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not test(value):  # every comparison with nan is false: nan fails any test written as one
        raise ConfigError(f"{name} must be a number {words} ({meaning}), got {text!r}")
    return value
