"""The vision zygote: a standby process spawned by the broker at boot. It imports everything the
vision worker runs and reads the vision weights into host RAM once, but creates no device context
and no thread (a fork after CUDA init, or while another thread holds a lock, is not allowed).
On each ``start`` it forks a fresh vision worker (workers/vision_worker.py), which pays only for its
context and the upload; the worker exits on stop and the zygote reaps it. What a worker would
otherwise do after its fork is done here once: the weights packed into one buffer (one upload,
workers/vision_weight_pack.py), a tiny image decoded and preprocessed (``warm_host_path``: Pillow's
format plugins load on its first open), and on cuda the host libraries its first kernels and
products load (``preload_libraries``: NVRTC, cuBLAS; no call that initialises the driver).

Its one loop owns the control socket (a Unix stream socket; JSON lines, see
broker/vision_control.py). A child that fails to start writes one line of reason into a pipe
before exiting; the zygote adds it to the ``exited`` event, so the image request that waited on the
start learns why (e.g. the emulated GPU had no room because a cache did not hand memory back)."""
from __future__ import annotations

import io
import json
import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from moebus.common.errors import ConfigError
from moebus.common.image_processor import load_image_processor
from moebus.common.parent_death import signal_on_parent_death
from moebus.common.vision_config import load_vision_config
from moebus.workers import vision_worker
from moebus.workers.vision_model import load_vision_weights
from moebus.workers.vision_spare import SpareMixin, spare_go
from moebus.workers.vision_weight_pack import pack

log = logging.getLogger("moebus.vision")
LOOP_S = 0.2
PRELOAD = os.environ.get("MOEBUS_VISION_PRELOAD", "1") != "0"  # 0: no library loads before the fork (A/Bs)
PACK_WEIGHTS = os.environ.get("MOEBUS_VISION_PACK", "1") != "0"  # 0: one upload per tensor (A/Bs)
MAX_REASON_BYTES = 4000  # below PIPE_BUF: one write, read whole


class Zygote(SpareMixin):
    def __init__(self, settings, model_dir: str, connect: str, device: str, control_path: str):
        self.settings = settings
        self.connect = connect
        self.device = device
        if device == "cuda":  # imported here (no context is created) so that no child imports it
            import moebus.cuda.backends.cuda  # noqa: F401
            from moebus.cuda.kernels.compat import load_numba_target

            load_numba_target()  # once here, not in each worker's warm-up (which then only loads kernels)
            if PRELOAD:
                preload_libraries()
        self.config = load_vision_config(model_dir)
        self.processor = load_image_processor(model_dir)  # LLaVA's or Qwen3-VL's
        warm_host_path(self.processor, settings)
        # host RAM, shared copy-on-write with each child; one buffer, so one upload in each
        self.weights = pack(load_vision_weights(model_dir)) if PACK_WEIGHTS else load_vision_weights(model_dir)
        self.forked_at: float | None = None
        self.charge = vision_worker.charge_bytes(self.config, self.weights, self.processor)
        try:  # (a bad MOEBUS_VISION_STREAM_LAYERS is the worker's start's config error, said there)
            self.cuda_bytes = vision_worker.cuda_device_bytes(self.config, self.weights, self.processor)
        except ConfigError:
            self.cuda_bytes = 0
        self.control_path = control_path
        self.listener: socket.socket | None = None
        self.conn: socket.socket | None = None
        self.children: dict[int, int] = {}  # pid -> read end of its reason pipe
        self.spare = None  # a child forked ahead (vision_spare.py; MOEBUS_VISION_PREFORK=0: none)
        self.stopping = False

    # -- the loop -----------------------------------------------------------------------------

    def serve(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # a child's exit wakes the select at once (through a pipe that the signal writes to)
        self.wakeup_fd, wakeup_write = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        os.set_blocking(wakeup_write, False)
        signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        path = Path(self.control_path)
        path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        log.info("vision zygote ready: %d tensors in host RAM, %.1f MiB to charge per worker",
                 len(self.weights), self.charge / (1 << 20))
        self._fork_spare(0)
        buffer = b""
        while not self.stopping:
            sources = [self.listener, self.wakeup_fd] + ([self.conn] if self.conn else [])
            readable, _, _ = select.select(sources, [], [], LOOP_S)
            if self.wakeup_fd in readable:
                _drain(self.wakeup_fd)
            if self.listener in readable:
                self._accept()
            if self.conn is not None and self.conn in readable:
                chunk = self.conn.recv(4096)
                if not chunk:  # the broker went away; it reconnects, or we die with it
                    self.conn.close()
                    self.conn, buffer = None, b""
                else:
                    *lines, buffer = (buffer + chunk).split(b"\n")
                    for line in lines:
                        self._command(line)
            self._reap()
        self._drop_spare()
        for pid in list(self.children):
            os.kill(pid, signal.SIGKILL)
        self._reap(block=True)
        return 0

    def _on_signal(self, _signum, _frame) -> None:
        self.stopping = True

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        if self.conn is not None:
            self.conn.close()
        self.conn = conn
        self._emit({"event": "hello", "pid": os.getpid(), "charge_bytes": self.charge, "cuda_bytes": self.cuda_bytes})

    def _emit(self, event: dict) -> None:
        if self.conn is not None:
            try:
                self.conn.sendall(json.dumps(event).encode() + b"\n")
            except OSError:
                self.conn.close()
                self.conn = None

    def _command(self, line: bytes) -> None:
        try:
            message = json.loads(line)
            command = message.get("cmd")
        except (ValueError, AttributeError):
            log.error("invalid control line dropped")
            return
        if command == "start":
            gpu = message.get("gpu", 0)
            if isinstance(gpu, int) and not isinstance(gpu, bool) and 0 <= gpu < self._num_gpus():
                self._fork(gpu)
            else:
                log.error("start on gpu %r: there is no such GPU; dropped", gpu)
        elif command == "kill":
            for pid in self.children:
                os.kill(pid, signal.SIGKILL)
        else:
            log.error("unknown control command %r dropped", command)

    def _reap(self, block: bool = False) -> None:
        self._reap_spare()
        for pid in list(self.children):
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done == 0:
                continue
            reason = self._read_reason(self.children.pop(pid))
            code = os.waitstatus_to_exitcode(status)
            log.info("vision worker %d exited with status %d%s", pid, code, f": {reason}" if reason else "")
            self._emit({"event": "exited", "pid": pid, "status": code, "reason": reason})
            if not self.children and not self.stopping:
                self._fork_spare(self.last_gpu)

    @staticmethod
    def _read_reason(fd: int) -> str:
        try:
            return os.read(fd, MAX_REASON_BYTES).decode(errors="replace").strip()
        except OSError:
            return ""
        finally:
            os.close(fd)

    # -- the child ----------------------------------------------------------------------------

    def _num_gpus(self) -> int:
        return len(self.settings.gpus) if self.device == "cuda" else len(self.settings.emulated_vram_mib)

    last_gpu = 0  # the GPU of the last start: a spare is forked for it

    def _fork(self, gpu: int) -> None:
        if self.children:
            log.error("start asked while vision worker %s still runs; ignored", list(self.children))
            return
        self.last_gpu = gpu
        woken = self._wake_spare(gpu)
        if woken is None:
            self._drop_spare()  # (one for another GPU, or dead)
        pid, read_fd = woken or self._fork_child(gpu)
        self.children[pid] = read_fd
        self._emit({"event": "started", "pid": pid})

    def _fork_child(self, gpu: int, go: tuple[int, int] | None = None) -> tuple[int, int]:
        """(pid, the read end of its reason pipe) of a child forked now (``go``: a spare's go pipe,
        its read and write ends)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        self.forked_at = time.time()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            if go is not None:
                os.close(go[1])  # (or its read would never see the pipe's end)
            os._exit(self._child(write_fd, gpu, None if go is None else go[0]))
        os.close(write_fd)
        return pid, read_fd

    def _child(self, reason_fd: int, gpu: int, go_fd: int | None = None) -> int:
        """The forked vision worker on ``gpu`` (worker order); never returns into the zygote's loop.
        No CUDA context exists yet, so choosing the device here is still possible. ``go_fd``: a
        spare's go pipe, which the zygote writes its start's time.time() into (or closes)."""
        try:
            for sock in (self.listener, self.conn):
                if sock is not None:
                    sock.close()
            signal.set_wakeup_fd(-1)
            os.close(self.wakeup_fd)
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal_on_parent_death(signal.SIGKILL)
            if self.device == "cuda":
                os.environ["CUDA_VISIBLE_DEVICES"] = str(self.settings.gpus[gpu])
            go = None if go_fd is None else spare_go(go_fd)
            return vision_worker.run_vision_worker(self.settings, self.config, self.weights, self.processor,
                                                   self.connect, self.device, self.charge, gpu, self.forked_at, go)
        except BaseException as e:  # noqa: BLE001 - the reason goes to the broker through the zygote
            log.error("vision worker failed: %s", "".join(traceback.format_exception_only(type(e), e)).strip())
            os.write(reason_fd, f"{type(e).__name__}: {e}"[:MAX_REASON_BYTES].encode())
            return 4
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def warm_host_path(processor, settings) -> None:
    """Decode and preprocess a tiny PNG once, as an ENCODE does: Pillow's format plugins and the
    first call's imports load here, before the fork, not in a cold request's first encode."""
    from PIL import Image

    from moebus.common.images import ImageLimits, decode_image

    started = time.perf_counter()
    data = io.BytesIO()
    Image.new("RGB", (64, 48)).save(data, format="PNG")
    try:
        with decode_image(data.getvalue(), ImageLimits.from_settings(settings.vision), "warm-up") as image:
            processor.preprocess(image)
    except Exception as e:  # noqa: BLE001 - an optional speed-up: the first request pays it instead
        log.warning("vision zygote: the image path was not warmed (%s: %s)", type(e).__name__, e)
        return
    log.info("vision zygote: image decode and preprocessing warmed in %.1f ms", 1e3 * (time.perf_counter() - started))


def preload_libraries() -> dict[str, float]:
    """Load the host libraries that a vision worker's first kernels and products would load after
    its fork (seconds each, logged): NVRTC (numba's cache key and the flash attention cubin's name
    ask its version), cuBLAS and cuBLASLt (nvmath's bindings resolve their symbols; they ask only
    cuDriverGetVersion, which does not initialise the driver). A library that is missing is left
    to the worker, as before."""
    steps = {"nvrtc": _load_nvrtc, "cublas": _load_cublas}
    seconds = {}
    for name, load in steps.items():
        started = time.perf_counter()
        try:
            load()
        except Exception as e:  # noqa: BLE001 - an optional speed-up: the worker loads it itself
            log.warning("vision zygote: %s not preloaded (%s: %s)", name, type(e).__name__, e)
            continue
        seconds[name] = time.perf_counter() - started
    log.info("vision zygote preloaded %s",
             ", ".join(f"{name} in {1e3 * s:.1f} ms" for name, s in seconds.items()) or "nothing")
    return seconds


def _load_nvrtc() -> None:
    from numba.cuda.cudadrv import runtime

    runtime.get_version()


def _load_cublas() -> None:
    from nvmath.bindings._internal import cublas

    cublas._inspect_function_pointers()  # dlopen and dlsym, no cuBLAS call


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _cuda_initialised() -> bool:
    """Has anything in this process called cuInit? (numba records the pid that did.)"""
    from numba.cuda.cudadrv import driver

    return getattr(driver.driver, "pid", None) is not None


def run_zygote(settings, model_dir: str, connect: str, device: str, control_path: str) -> int:
    zygote = Zygote(settings, model_dir, connect, device, control_path)
    if device == "cuda" and _cuda_initialised():  # every forked child's CUDA would be broken
        raise RuntimeError("the vision zygote initialised CUDA while importing; it must not before forking")
    num_threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if num_threads != 1:  # a thread holding a lock at fork time would deadlock the child
        log.warning("vision zygote has %d threads before forking", num_threads)
    return zygote.serve()
