"""Emulated VRAM for the cpu device: one ledger file per emulated GPU, shared by every process on
the host, holding the GPU's capacity and what each process has allocated. An allocation that does
not fit fails, exactly as cudaMalloc would, so a process only gets memory that the others really
handed back. Entries of dead processes are dropped on every access."""
from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

MIB = 1 << 20


class OutOfMemory(MemoryError):
    """An emulated allocation did not fit (the cpu device's cudaErrorMemoryAllocation)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = Path(f"/proc/{pid}/stat")
    try:  # a zombie has released everything
        return state.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class EmulatedGpu:
    """The ledger of one emulated GPU at ``path``; ``capacity_mib`` set by whoever creates it."""

    def __init__(self, path: str | Path, capacity_mib: float | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()
        with self._locked() as state:
            if capacity_mib is not None:
                state["capacity_bytes"] = int(capacity_mib * MIB)
            elif "capacity_bytes" not in state:
                raise FileNotFoundError(f"{self.path}: no emulated GPU here (capacity not set)")

    @contextmanager
    def _locked(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            raw = f.read()
            state = json.loads(raw) if raw else {"usage": {}}
            state["usage"] = {k: v for k, v in state.get("usage", {}).items() if _alive(int(k.split(":")[0]))}
            yield state
            f.seek(0)
            f.truncate()
            f.write(json.dumps(state))

    def _key(self, tag: str) -> str:
        return f"{self.pid}:{tag}"

    def allocate(self, num_bytes: int, tag: str = "default") -> None:
        with self._locked() as state:
            used = sum(state["usage"].values())
            if used + num_bytes > state["capacity_bytes"]:
                raise OutOfMemory(f"emulated GPU {self.path.name}: {num_bytes / MIB:.1f} MiB requested, "
                                  f"{(state['capacity_bytes'] - used) / MIB:.1f} MiB free")
            key = self._key(tag)
            state["usage"][key] = state["usage"].get(key, 0) + int(num_bytes)

    def release(self, num_bytes: int, tag: str = "default") -> None:
        with self._locked() as state:
            key = self._key(tag)
            left = state["usage"].get(key, 0) - int(num_bytes)
            if left < 0:
                raise ValueError(f"releasing {num_bytes} bytes more than {tag!r} holds")
            if left:
                state["usage"][key] = left
            else:
                state["usage"].pop(key, None)

    def held(self, tag: str = "default") -> int:
        with self._locked() as state:
            return state["usage"].get(self._key(tag), 0)

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes, like cuMemGetInfo."""
        with self._locked() as state:
            total = state["capacity_bytes"]
            return total - sum(state["usage"].values()), total
