"""The vision worker's place among the clients of NVIDIA's Multi-Process Service (MPS), where one runs.

Without MPS each process on a GPU has its own context and the GPU time-slices between them: while the
vision worker's tower runs, a text step's kernels wait for the tower's slice to end. Under an MPS server
the processes' kernels share the GPU's SMs, and a client can ask to be served after the others
(``CUDA_MPS_CLIENT_PRIORITY`` 1, "below normal") or on a share of the SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). The driver reads both when the process makes its context, so
they go into the zygote's environment, which each forked vision worker inherits; the text workers keep
the normal priority and every SM. Where no MPS server runs the driver ignores them."""
from __future__ import annotations

import os

from moebus.common.env_switches import number_from_env
from moebus.common.errors import ConfigError

PRIORITY_ENV = "MOEBUS_VISION_MPS_PRIORITY"
THREAD_PERCENT_ENV = "MOEBUS_VISION_MPS_THREAD_PERCENT"
PERCENT = (lambda value: 1 <= value <= 100 and value == int(value), "from 1 to 100, whole")


def vision_client_env(environ=os.environ) -> dict[str, str]:
    """The CUDA_MPS_* variables the vision worker's process gets (empty where none is asked):
    MOEBUS_VISION_MPS_PRIORITY (0 normal, 1 below normal) and MOEBUS_VISION_MPS_THREAD_PERCENT (the
    share of the SMs its kernels may use, 1-100)."""
    env = {}
    priority = environ.get(PRIORITY_ENV, "")
    if priority:
        if priority not in ("0", "1"):
            raise ConfigError(f"{PRIORITY_ENV} must be 0 (normal) or 1 (below normal: the text workers' kernels "
                              f"first, under an MPS server), got {priority!r}")
        env["CUDA_MPS_CLIENT_PRIORITY"] = priority
    if environ.get(THREAD_PERCENT_ENV, ""):
        percent = number_from_env(THREAD_PERCENT_ENV, "100", "the share of the SMs the vision worker's kernels "
                                  "may use under an MPS server", environ, within=PERCENT)
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(percent))
    return env
