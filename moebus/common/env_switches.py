"""An on/off switch in the environment (``MOEBUS_…=0|1``), read where the part it switches is made."""
from __future__ import annotations

import os

from moebus.common.errors import ConfigError


def switch_from_env(name: str, environ=os.environ, default: bool = False) -> bool:
    """``name`` as 0 or 1 (unset: ``default``), else a ConfigError naming it."""
    text = environ.get(name, "1" if default else "0")
    if text not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"
