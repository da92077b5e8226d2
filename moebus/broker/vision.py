"""The vision lifecycle, driven from the broker's one loop (``tick`` on every turn, ``on_message``
for what the vision worker sends, ``on_event`` for the zygote's control events). States:

    cold --image--> handing_back --all VRAM replies--> starting --VISION_READY--> ready
    ready --idle_s without images--> stopping --worker exited--> regrowing --bare VRAM done--> cold

An image request waits in ``waiting`` (never in the scheduler) until its embeddings are back; text
requests keep decoding throughout, since each worker applies the hand-back's VRAM fan-outs between
two of its steps (broker/vision_handback.py) and the start runs in another process. A new image
during stopping or regrowing waits and starts the worker again. With ``vision.lazy`` false the worker is started once every GPU worker is ready and
is never stopped for idleness. The choices of one request (an ``image_group``) are encoded once:
the first leads, the others wait for its embeddings outside ``waiting`` (broker/vision_groups.py)."""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from PIL import Image

from moebus.broker import vision_qwen3vl
from moebus.broker.vision_control import ZygoteControl
from moebus.broker.vision_encodes import READY, STARTING, EncodeMixin
from moebus.broker.vision_groups import ImageGroups
from moebus.broker.vision_handback import Handback, regrow_plan
from moebus.broker.vision_phases import PhaseSteps, cold_start_split
from moebus.broker.vision_placement import (Placement, PlacementMixin, default_vram_mib, margin_mib_from_env,  # noqa: F401
                                            short_of)
from moebus.broker.vision_requests import (ImageRequest, admit_image_request, admit_text_request,  # noqa: F401
                                           has_images, step_embeds)
from moebus.common.errors import ServerBusy
from moebus.common.image_processor import load_image_processor
from moebus.common.protocol import Final, Heartbeat, Shutdown

log = logging.getLogger("moebus.broker")
COLD, HANDING_BACK, STOPPING, REGROWING = "cold", "handing_back", "stopping", "regrowing"  # STARTING, READY: vision_encodes
STOP_GRACE_S = 10.0  # a worker told to stop that has not exited by then is killed
MAX_BACKOFF_S = 30.0
MIB = 1 << 20


@dataclass
class VisionHooks:
    """What the lifecycle may ask of the broker."""

    send: Callable  # (message) -> None, to the vision worker over the backend socket
    queue_vram: Callable  # (reserves per GPU or None for bare, on_done(VramReply), interim=, between_steps=) -> None
    submit: Callable  # (Sequence) -> None: into the scheduler; raises ServerBusy
    reply: Callable  # (client, message) -> None
    workers_ready: Callable  # () -> bool
    worker_info: Callable  # () -> [each GPU worker's last INFO stats ({} before its first)]
    decoding: Callable  # () -> bool: sequences are running (the hand-back lets a step pass between its parts)
    steps_sent: Callable  # () -> int: decode steps sent to the workers so far (started; aborted ones may drop out)
    ask_info: Callable  # () -> None: every ready GPU worker is asked for INFO (the cold start's cache counters)


class VisionLifecycle(PlacementMixin, EncodeMixin):
    def __init__(self, settings, vision_config, num_gpus: int, zygote, control_path: str, hooks: VisionHooks,
                 stats):
        self.settings = settings
        self.config = vision_config  # common/vision_config.py VisionConfig
        self.vision = settings.vision
        self.num_gpus = num_gpus
        self.zygote = zygote  # a Child (None: tests drive the zygote themselves)
        self.control = ZygoteControl(control_path)
        self.hooks = hooks
        self.stats = stats
        self.state = COLD
        self.zygote_info: dict | None = None  # the zygote's hello: it is ready to fork
        self.waiting: deque[ImageRequest] = deque()
        self.encoding: ImageRequest | None = None
        self.encode_ids = iter(range(1, 1 << 62))
        self.encode_id = 0
        self.generation: str | None = None
        self.worker_pid: int | None = None
        self.since_s = self.last_seen_s = self.next_beat_s = self.last_image_s = 0.0
        self.backoff_s, self.next_start_s = 0.5, 0.0
        self.last_cycle: dict = {}
        self.phase_steps = PhaseSteps(stats)  # the last cold start's decode steps by phase (vision_phases.py)
        self.kill_reason: str | None = None  # why the broker had the worker killed, for the error it causes
        self.groups = ImageGroups()  # the choices of one request, which share one encode
        # Qwen3-VL: image token counts come from each image's size, through its processor's settings
        self.processor = load_image_processor(settings.model) if vision_config.tower == "qwen3_vl" else None
        self.placement: Placement | None = None  # where the next start goes (vision_placement.py)
        self.handback_free_mib: float | None = None  # free on the vision GPU after the last hand-back
        self.measured_bytes: dict[int, int] = {}  # gpu -> what the last start there took (cuda; reserves())
        self.worker_gpu = 0  # the running vision worker's GPU (its VISION_READY's)
        self.margin_mib = margin_mib_from_env()  # above a measured footprint (vision_placement.py)
        self.handback: Handback | None = None  # the hand-back or regrow in progress, in steps (vision_handback.py)
        self.held_reserves: list[float | None] | None = None  # what the last hand-back asked; the regrow starts there
        Image.init()  # Pillow's format plugins, loaded now rather than inside the first image request

    # -- the broker's hooks -------------------------------------------------------------------

    def start(self) -> None:
        if self.zygote is not None:
            self.zygote.start()

    def stop(self) -> None:
        for req in list(self.waiting) + ([self.encoding] if self.encoding else []):
            self._fail(req, "server shutting down", 503)  # and the choices that follow it
        self.waiting.clear()
        self.encoding = None
        if self.generation is not None:
            self.hooks.send(Shutdown())
        self.control.close()
        if self.zygote is not None:
            self.zygote.stop()

    def admission(self, msg, client: bytes, tokenizer, vocab_size: int, max_context: int):
        """Every GENERATE for this model, on the broker's tokenizer threads (it only reads settings):
        with images an ImageRequest, which the broker then ``submit``s here; without, a Sequence for
        the scheduler whose prompt holds no image token. Raises RequestError (the broker answers it)."""
        if self.processor is not None:
            vision_qwen3vl.refuse_video(msg)
        if not has_images(msg):
            return admit_text_request(msg, client, tokenizer, vocab_size, max_context, self.config.image_token_id)
        if self.processor is not None:
            return vision_qwen3vl.admit_qwen3vl_request(msg, client, tokenizer, vocab_size, max_context, self.vision,
                                                        self.config, self.processor)
        return admit_image_request(msg, client, tokenizer, vocab_size, max_context, self.vision,
                                   self.config.image_token_id, self.config.num_image_tokens)

    def submit(self, req: ImageRequest) -> None:
        if len(self.waiting) >= self.settings.max_queue:
            raise ServerBusy(f"server busy: {len(self.waiting)} image requests waiting (max_queue)")
        group = self.groups.join(req)
        if group is not None and group.is_done:  # a late choice: its leader's embeddings (or error) are in
            self.groups.take(group)
            if group.error is not None:
                self._reply_error(req, group.error)
            else:
                self._reuse(req, group.embeds)
            return
        if group is not None:
            return  # another choice of its request leads: it waits for that one's encode
        if self.state in (STOPPING, REGROWING):
            log.info("image request %s arrived while the vision worker is %s: it waits, then starts it again",
                     req.seq.id, self.state)
        self.waiting.append(req)

    def find(self, request_id: str) -> ImageRequest | None:
        if self.encoding is not None and self.encoding.seq.id == request_id:
            return self.encoding
        return next((r for r in [*self.waiting, *self.groups.followers()] if r.seq.id == request_id), None)

    def cancel(self, request_id: str, client: bytes) -> bool:
        """Cancel an image request that has not reached the scheduler; False: not one of ours."""
        req = self.find(request_id)
        if req is None or req.seq.client != client:
            return False
        heir = self.groups.cancelled(req)  # another choice of its request takes over its place and encode
        if heir is not None:
            heir.encode_sent_s = req.encode_sent_s
            log.info("image request %s cancelled: %s takes over its %s", request_id, heir.seq.id,
                     "encode" if req is self.encoding else "place in the queue")
        if req is self.encoding and heir is not None:
            self.encoding = heir
        elif req is self.encoding:
            self.encoding = None  # its reply, when it comes, is dropped (encode_id no longer matches)
            self.encode_id = 0
            self.last_image_s = time.monotonic()
        elif req in self.waiting and heir is not None:
            self.waiting[self.waiting.index(req)] = heir
        elif req in self.waiting:
            self.waiting.remove(req)
        self.hooks.reply(client, Final(id=request_id, finish_reason="cancelled", prompt_tokens=len(req.seq.prompt),
                                       completion_tokens=0))
        return True

    def info(self) -> dict:
        return {"vision_loaded": int(self.state == READY),
                "vision": {"state": self.state, "pid": self.worker_pid, "gpu": self.gpu,
                           "gpu_setting": self.vision.gpu, "lazy": self.vision.lazy,
                           "placement": self.placement.to_dict() if self.placement else None,
                           "problem": self.placement.problem if self.placement else None,  # a row of the page
                           "vram_mib": self.reserves(),
                           "measured_mib": self.measured_mib(),
                           "waiting": len(self.waiting) + (self.encoding is not None) + len(self.groups.followers()),
                           "zygote_ready": self.zygote_info is not None, "last_cold_start": cold_start_split(self.last_cycle, self.phase_steps)}}

    # -- the loop -----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        self._supervise_zygote()
        seq = self.last_cycle.get("seq")
        if seq is not None and seq.first_token_s is not None:
            self.phase_steps.mark("first_token")
        self.groups.expire(now)
        for event in self.control.poll():
            self.on_event(event, now)
        placement = self._place() if self.state == COLD and self.hooks.workers_ready() else None
        if placement is not None and self._wanted() and now >= self.next_start_s:
            if placement.gpu is None:
                self._refuse_waiting(placement.problem)
            else:
                self._hand_back(now)
        elif self.state in (HANDING_BACK, REGROWING) and self.handback is not None:
            self.handback.tick(now)
        elif self.state == STARTING and now - self.since_s > self.vision.start_timeout_s:
            log.error("vision worker not ready after %.0f s; killing it", now - self.since_s)
            self.kill_reason = f"not ready within vision.start_timeout_s ({self.vision.start_timeout_s:g} s)"
            self.control.send("kill")
            self.since_s = now  # one kill per timeout; the exit event ends the start
        elif self.state == READY:
            self._serve(now)
        elif self.state == STOPPING and now - self.since_s > STOP_GRACE_S:
            self.control.send("kill")
            self.since_s = now
        if self.state in (STARTING, READY, STOPPING) and now >= self.next_beat_s:
            self.next_beat_s = now + self.settings.broker.heartbeat_s
            self.hooks.send(Heartbeat())
        if self.zygote_info is None:
            self._expire_waiting(now)

    def _wanted(self) -> bool:
        return bool(self.waiting) or not self.vision.lazy

    def _serve(self, now: float) -> None:
        if now - self.last_seen_s > self.settings.broker.heartbeat_s * self.settings.broker.heartbeat_liveness:
            log.error("vision worker missed heartbeats for %.1f s; killing it", now - self.last_seen_s)
            self.kill_reason = "it missed its heartbeats"
            self.control.send("kill")
            self.last_seen_s = now
            return
        if self.encoding is None and self.waiting:
            self._send_encode(self.waiting.popleft(), now)
        elif self.encoding is None and self.vision.lazy and now - self.last_image_s >= self.vision.idle_s:
            log.info("vision idle for %.1f s: stopping the vision worker", now - self.last_image_s)
            self.hooks.send(Shutdown())
            self.state, self.since_s = STOPPING, now

    def _expire_waiting(self, now: float) -> None:
        """No zygote to fork from (still loading, or restarting): requests wait at most start_timeout_s."""
        for req in [r for r in self.waiting if now - r.arrived_s > self.vision.start_timeout_s]:
            self.waiting.remove(req)
            self._fail(req, "the vision worker is not available (its zygote is not ready)", 503)

    def _supervise_zygote(self) -> None:
        if self.zygote is None:
            return
        status = self.zygote.exited()
        if status is not None:
            log.error("vision zygote exited with status %s; restarting", status)
            self.on_event({"event": "gone"}, time.monotonic())
        self.zygote.maybe_restart()

    # -- start, stop ----------------------------------------------------------------------------

    def _hand_back(self, now: float) -> None:
        self.state, self.since_s = HANDING_BACK, now
        self.last_cycle = {"began_s": now, "queued_s": now - self.waiting[0].arrived_s if self.waiting else 0.0}
        self.phase_steps = PhaseSteps(self.stats, self.num_gpus, self.hooks.ask_info)
        self.phase_steps.mark("began")
        free = [info.get("free_mib") for info in self.hooks.worker_info()]
        self.held_reserves = self.reserves()
        self.handback = Handback(self.held_reserves, self.vision.handback_step_mib, self.hooks.queue_vram,
                                 self.hooks.steps_sent, self.hooks.decoding, self._handed_back, free)
        self.last_cycle["handback_requests"] = len(self.handback.plan)
        self.handback.start()

    def _handed_back(self, reply) -> None:
        now = time.monotonic()
        self.handback = None
        if reply.error:
            log.warning("vision hand-back: %s", reply.error)
        free = reply.free_mib if isinstance(reply.free_mib, list) else [reply.free_mib]
        self.handback_free_mib = free[self.gpu] if self.gpu < len(free) and not reply.error else None
        self.last_cycle["handback_s"] = now - self.last_cycle["began_s"]
        self.phase_steps.mark("handed_back")
        self.last_cycle["handed_back_s"] = now
        if not self.control.send("start", gpu=self.gpu):
            self._start_failed("the vision zygote is not connected", now)
            return
        self.state, self.since_s = STARTING, now

    def _refuse_waiting(self, problem: str) -> None:
        """No GPU can make room: the waiting image requests learn why now, not after a failed start."""
        for req in list(self.waiting):
            self._fail(req, f"the vision worker cannot start: {problem}", 503, code="vision_unavailable")
        self.waiting.clear()

    def _start_failed(self, reason: str, now: float) -> None:
        if "OutOfMemory" in reason or "out of memory" in reason.lower():
            reason += short_of(self._need_mib(self.gpu), self.handback_free_mib, self.gpu, self.settings.device)
        for req in list(self.waiting):
            self._fail(req, f"the vision worker could not start: {reason}", 503, code="vision_unavailable")
        self.waiting.clear()
        self.next_start_s = now + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, MAX_BACKOFF_S)
        self._regrow()

    def _regrow(self) -> None:
        """Every cache back to its start-up size, in steps as the hand-back (vision_handback.py); an
        image that comes meanwhile waits for the last step, then starts the worker again."""
        self.state = REGROWING
        held = self.held_reserves or [None] * self.num_gpus
        self.handback = Handback(held, self.vision.handback_step_mib, self.hooks.queue_vram, self.hooks.steps_sent,
                                 self.hooks.decoding, self._regrown,
                                 plan=regrow_plan(held, self.vision.handback_step_mib))
        self.handback.start()

    def _regrown(self, reply) -> None:
        self.handback = None
        if reply.error:
            log.warning("vision regrow: %s", reply.error)
        self.held_reserves = None
        self.state = COLD

    def on_event(self, event: dict, now: float) -> None:
        kind = event.get("event")
        if kind == "hello":
            self.zygote_info = event
            if self.zygote is not None:
                self.zygote.mark_ready()
            log.info("vision zygote ready (pid %s, %.1f MiB to charge)", event.get("pid"),
                     event.get("charge_bytes", 0) / MIB)
        elif kind == "started":
            self.worker_pid = event.get("pid")
        elif kind == "exited" and event.get("pid") == self.worker_pid:
            reason = self.kill_reason or event.get("reason") or f"exit status {event.get('status')}"
            self.kill_reason = None
            self._exited(reason, now)
        elif kind == "gone":
            self.zygote_info = None
            if self.state in (STARTING, READY, STOPPING):
                self._exited("the vision zygote exited", now)

    def _exited(self, reason: str, now: float) -> None:
        was, self.worker_pid, self.generation = self.state, None, None
        if self.encoding is not None:
            self._fail(self.encoding, f"the vision worker died during the encode ({reason})", 503,
                       code="vision_unavailable")
            self.encoding = None
        if was == STARTING:
            log.error("vision worker failed to start (%s)", reason)
            self._start_failed(reason, now)
        elif was == STOPPING:
            if self.waiting:  # an image came during the stop: start again (the hand-back is cheap if still free)
                self._hand_back(now)
            else:
                self._regrow()
        else:
            log.error("vision worker exited (%s)", reason)
            self._regrow()
