"""The vision lifecycle's side of the vision worker (a mixin of VisionLifecycle, whose state it
uses): its VISION_READY, the ENCODE of one request at a time and its reply, and the errors that
answer an image request and the choices waiting for its encode (broker/vision_groups.py)."""
from __future__ import annotations

import logging
import time

from moebus.broker import vision_qwen3vl
from moebus.broker.vision_requests import ImageRequest
from moebus.common.errors import ServerBusy
from moebus.common.protocol import Encode, EncodeReply, Error, VisionReady, WorkerError

log = logging.getLogger("moebus.broker")
MIB = 1 << 20
STARTING, READY = "starting", "ready"  # states of the lifecycle (vision.py) that these messages move


class EncodeMixin:
    def on_message(self, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, VisionReady):
            self._on_ready(msg, now)
            return
        if getattr(msg, "generation", None) != self.generation or self.generation is None:
            return  # from an earlier vision worker: its requests have been answered already
        self.last_seen_s = now
        if isinstance(msg, EncodeReply):
            self._on_encoded(msg, now)
        elif isinstance(msg, WorkerError):
            log.error("vision worker: %s", msg.message)
            if self.encoding is not None and msg.step_id == self.encode_id:
                self._fail(self.encoding, f"the vision worker failed the encode: {msg.message}", 500)
                self.encoding, self.last_image_s = None, now

    def _on_ready(self, msg: VisionReady, now: float) -> None:
        for event in self.control.poll():  # the zygote's "started" may still be unread
            self.on_event(event, now)
        if self.state != STARTING or msg.pid != self.worker_pid:
            if msg.pid != self.worker_pid:
                log.error("VISION_READY from pid %d, expected %s: dropped", msg.pid, self.worker_pid)
            return
        self.state, self.generation = READY, msg.generation
        self.last_seen_s = self.last_image_s = now
        self.backoff_s = 0.5
        began = self.last_cycle.get("handed_back_s", now)
        self.last_cycle.update(start_s=now - began, worker_start_s=msg.start_s, ready_s=now)
        self.phase_steps.mark("ready")
        self.stats.count("vision_starts_total")
        self.stats.observe("vision_start_seconds", now - self.last_cycle.get("began_s", now))
        log.info("vision worker ready on gpu%d (pid %d, %.1f MiB on the device, start %.2f s)", msg.gpu, msg.pid,
                 msg.device_bytes / MIB, now - self.last_cycle.get("began_s", now))
        self.worker_gpu = msg.gpu
        # the next hand-back on that GPU frees this (and a margin), not the default
        self.record_measured(msg.gpu, msg.measured_bytes, "start")  # (without a warm-up: its first encode's
        # scratch reckoned, until that encode's reply measures it)

    def _send_encode(self, req: ImageRequest, now: float) -> None:
        self.encode_id = next(self.encode_ids)
        req.encode_sent_s = now
        self.encoding = req
        if "ready_s" in self.last_cycle:  # the cold start's first encode (the mark is kept once)
            self.phase_steps.mark("encode_sent")
        self.hooks.send(Encode(encode_id=self.encode_id, request_id=req.seq.id, images=req.images))

    def _on_encoded(self, msg: EncodeReply, now: float) -> None:
        self.record_measured(self.worker_gpu, msg.measured_bytes, "start and first encode")  # (cancelled or not)
        req = self.encoding
        if req is None or msg.encode_id != self.encode_id:
            return  # its request was cancelled meanwhile
        self.encoding, self.last_image_s = None, now
        self.stats.observe("vision_encode_seconds", now - req.encode_sent_s)
        if msg.error is not None:
            where = f"images[{msg.image}]" if msg.image is not None else "images"
            self._fail(req, msg.error, 400, kind="invalid_request_error", param=where, code="invalid_image")
            return
        seq = req.seq
        embeds = vision_qwen3vl.stacked_embeds(msg.embeds, msg.deepstack, len(seq.embed_positions))
        if embeds is None:
            self._fail(req, "the vision worker answered embeddings of the wrong shape", 500)
            return
        self.stats.count("images_total", len(req.images))
        vision_qwen3vl.attach_embeds(seq, embeds)
        followers = self.groups.encoded(req, embeds)
        if "encode_s" not in self.last_cycle and "start_s" in self.last_cycle:
            self.last_cycle.update(encode_s=now - req.encode_sent_s, submitted_s=now, seq=seq,
                                   ready_to_encode_s=req.encode_sent_s - self.last_cycle["ready_s"])
            self.phase_steps.mark("submitted")
        self._submit(req)
        for follower in followers:
            self._reuse(follower, embeds)

    def _reuse(self, req: ImageRequest, embeds) -> None:
        """Another choice's embeddings of the same images: no encode of its own."""
        self.stats.count("images_reused_total", len(req.images))
        vision_qwen3vl.attach_embeds(req.seq, embeds)
        self._submit(req)

    def _submit(self, req: ImageRequest) -> None:
        try:
            self.hooks.submit(req.seq)
        except ServerBusy as e:  # the queue filled while it was encoded
            self._fail(req, e.message, e.http_status, kind=e.kind)

    def _fail(self, req: ImageRequest, message: str, status: int, kind: str | None = None, param: str | None = None,
              code: str | None = None) -> None:
        """Answer ``req`` with an error, and with it the choices that were waiting for its encode."""
        kind = kind or ("service_unavailable" if status == 503 else "server_error")
        error = dict(message=message, type=kind, status=status, param=param, code=code)
        for failed in [req, *self.groups.failed(req, error)]:
            self._reply_error(failed, error)

    def _reply_error(self, req: ImageRequest, error: dict) -> None:
        self.stats.count("requests_failed_total")
        self.hooks.reply(req.seq.client, Error(id=req.seq.id, **error))

