"""A process that ends with its parent: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``), set in a
child right after its fork (or between fork and exec, as ``preexec_fn``), so that no child outlives a parent
that was SIGKILLed. Elsewhere (no libc.so.6) nothing is set."""
from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def signal_on_parent_death(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where it cannot."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except OSError:
        return False
