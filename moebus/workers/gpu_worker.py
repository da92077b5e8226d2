"""The GPU worker process: loads one stage (a contiguous range of layers) on its device, registers
with the broker (READY) and serves STEP / VRAM / INFO / SHUTDOWN until told to stop. A fatal device
error ends the process with a non-zero status: a poisoned CUDA context must not keep serving."""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moebus.common.checkpoint import Checkpoint
from moebus.common import transport
from moebus.common.protocol import (Info, InfoReply, Ready, Step, StepReply, Vram, VramReply,
                                    WorkerError)
from moebus.common.env_switches import switch_from_env
from moebus.common.errors import ConfigError
from moebus.common import gc_pauses
from moebus.common.image_steps import image_step_tokens
from moebus.cuda.backends import is_out_of_memory, make_backend
from moebus.cuda.kernels.compat import disk_cache_counts
from moebus.cuda.memory.arena import GRANULARITY
from moebus.cuda.memory.ledger import MIB
from moebus.workers import chunk_rows, overlap, spanning_chunk, step_trace, step_watch
from moebus.workers.batch import StepBatch, logit_rules_of, masks_of
from moebus.workers.cache_sizing import (CUDA_HEADROOM_BYTES, DeviceBudget, budget_bytes, emulated_gpu,
                                         max_free_bytes, measure_scratch, reserve_for, stage_dense_bytes, widened,
                                         startup_capacity_bytes)
from moebus.workers.experts import build_expert_cache
from moebus.workers.link import BrokerLink
from moebus.workers.kv_cache import resolve_kv_dtype
from moebus.workers.loop import serve
from moebus.workers.graph_warmup import warm_graphs, warm_prompt_sizes, warm_prompt_steps, warm_sizes
from moebus.workers.stage import ROUTED_MAX_TOKENS, Stage

log = logging.getLogger("moebus.worker")
PEEK_S = 2e-4  # how often a worker waiting for the next STEP looks whether its running step is done
SLOW_DECODE_FACTOR = 2.0  # a decode step this many times the recent median is logged (e.g. a GPU shared
SLOW_DECODE_MIN_S = 0.01  # with a starting vision worker: its context, uploads and warm-up)
# On cuda, for RESERVE_KEPT_S after a VRAM request that set a reserve (a vision worker starting beside: its
# context, weights, first encode), an INFO gives the sizes and the driver's figures of that request (a query
# refreshes them) and calls the driver not at all: on the H200 the first cuMemGetInfo while the vision worker
# made its context waited 18-26 ms, and the INFO the cold start's mark asks then held a text step that long
# (fifteenth session, with PDL on). MOEBUS_INFO_AT_RESERVE=driver: ask the driver always, as before.
INFO_AT_RESERVE = os.environ.get("MOEBUS_INFO_AT_RESERVE", "kept")
RESERVE_KEPT_S = 2.0
SLOW_INFO_S = 0.003  # an INFO that held the next step this long is logged (the driver's free memory is a driver call)
IDLE_LOGGED_S = (0.008, 1.0)  # a step that came this long after the last one ended is logged (the broker's time)
# on cuda, after the decode graphs: an eager prompt step of each GEMV token count no graph ran, and one past
# them (graph_warmup.warm_prompt_steps): a text stream's first 5-9-token step then loads or compiles nothing.
# Off by default until a GPU call has run it (tools/device/gap16.sh's run prompt1 turns it on)
WARM_PROMPT_STEPS = os.environ.get("MOEBUS_WARM_PROMPT_STEPS", "0") == "1"
LOG_STEPS = os.environ.get("MOEBUS_LOG_STEPS", "0") == "1"  # every step's time and the wait before it (a gap's parts)
# a VRAM reserve's step scratch (the vision worker's): "measured" (long steps borrow from the cache, a
# prompt-path loan that evicts experts the next steps miss) or "beside" (steps of up to the wide scratch's
# tokens, or an image step's (common/image_steps.py), take their buffers from what the device has free
# beyond the reserve and headroom, if it has; the pool's buffers beyond the wide scratch go when it ends)
RESERVE_SCRATCH = os.environ.get("MOEBUS_RESERVE_SCRATCH", "beside")
# A hand-back step's host time by part in its log line (ms): a spanning chunk's loan returned and the step pool's
# idle buffers released, cuMemGetInfo, the moves down and the table (out of service), reading the next step and
# launching it beside, the sync before the unmap, the unmap, the handles' release (ExpertCache.last_resize; the
# last three from VmmArena).
RESIZE_PARTS = (("scratch_s", "loan and step pool"), ("info_s", "free asked"), ("out_of_service_s", "out of service"),
                ("peek_s", "next step read"), ("beside_s", "its launch"), ("sync_s", "sync"), ("unmap_s", "unmap"),
                ("release_s", "release"))


def handback_beside_from_env(environ=os.environ) -> bool:
    """``MOEBUS_HANDBACK_BESIDE_STEP`` (default 1; 0: off): a VRAM reserve that releases segments launches the
    decode step queued behind it once the leaving slots are out of service, and unmaps them while that step
    runs (ExpertCache._shrink_for). On the H200 a hand-back request held the GPU idle ~3.5 ms and the step
    after it then ran unlaunched (~5 ms): the streams' largest gaps of the hand-back, 10.6-11.1 ms against a
    cycle median of ~6 (twenty-sixth session); beside the next step 11.7 ms where the same call's runs
    without it had 13.3-15.2, and 6.7-9.3 with the tower streamed too (twenty-ninth session, emb27.sh).
    Anything but 0 / 1 is a ConfigError naming it, raised at the worker's start."""
    return switch_from_env("MOEBUS_HANDBACK_BESIDE_STEP", environ, default=True)


class GpuWorker:
    def __init__(self, stage: Stage, link: BrokerLink, gpu: int, launch_ahead: bool = True, trace=None,
                 watch=None):
        """``trace``: a workers.step_trace.StepTrace (MOEBUS_TRACE_CHUNK_STEPS), or None; ``watch``: a
        workers.step_watch.StepWatch (MOEBUS_STEP_STACKS_S), or None."""
        self.watch = watch
        self.stage = stage
        self.launch_ahead = launch_ahead
        self.link = link
        self.gpu = gpu
        self.steps_served = 0
        self.busy_s = 0.0
        # the last step's sampled ids, which a STEP with tokens_from takes as its tokens
        self.last_step_id: int | None = None
        self.last_tokens = None
        self.ahead: dict[int, overlap.Launched | Exception] = {}  # step id -> launched early (workers/overlap.py)
        self.steps_launched_ahead = 0
        self.recent_decode_s: deque[float] = deque(maxlen=64)
        self.trace = trace
        self.last_step_end_s: float | None = None  # perf_counter when the last step's reply was made
        self.driver_info_s = 0.0  # the last INFO's driver call (cuMemGetInfo)
        # while a VRAM reserve holds, the sizes and the driver's figures as of the last VRAM request (INFO_AT_RESERVE)
        self.reserve_figures: dict | None = None
        self.handback_beside = handback_beside_from_env() and launch_ahead  # (a bad value refused either way)
        self.steps_launched_beside = 0  # decode steps launched within a VRAM request (handback_beside_from_env)

    def serve(self) -> int:
        """The worker loop (workers/loop.py). Returns the process exit status."""
        return serve(self.link, self.handle, self.failure)

    def failure(self, message, text: str, fatal: bool):
        """The answer to a message that failed: the broker waits on a VRAM reply by its id."""
        if isinstance(message, Vram) and not fatal:
            return VramReply(id=message.id, reserve_mib=0, free_mib=0, expert_slots=0, expert_cache_mib=0, error=text)
        return WorkerError(generation=self.link.generation, message=text, step_id=getattr(message, "step_id", None),
                           fatal=fatal)

    def handle(self, message):
        if isinstance(message, Step):
            return self.step(message)
        if isinstance(message, Info):
            return self.info()
        if isinstance(message, Vram):
            return self.vram(message)
        raise ValueError(f"unexpected message {type(message).__name__}")

    def step(self, msg: Step) -> StepReply:
        if self.watch is not None:  # MOEBUS_STEP_STACKS_S (workers/step_watch.py)
            self.watch.begin(msg.step_id)
            try:
                return self.traced_step(msg)
            finally:
                self.watch.end()
        return self.traced_step(msg)

    def traced_step(self, msg: Step) -> StepReply:
        if self.trace is None:
            return self._step(msg)
        held = self.stage.chunk  # MOEBUS_TRACE_CHUNK_STEPS (workers/step_trace.py)
        self.trace.before(msg.step_id, msg.slots, msg.lengths, None if held is None else held.slot)
        try:
            return self._step(msg)
        finally:
            self.trace.after()

    def info(self) -> InfoReply:
        """An INFO waits behind the step in flight and holds the next one: a slow one is logged."""
        started = time.perf_counter()
        reply = InfoReply(stats=self.stats())
        if (took := time.perf_counter() - started) > SLOW_INFO_S:
            log.info("gpu%d: INFO took %.1f ms (the driver's free memory %.1f ms)", self.gpu, 1e3 * took,
                     1e3 * self.driver_info_s)
        return reply

    def _step(self, msg: Step) -> StepReply:
        started = time.perf_counter()
        counted = self.cache_counts() if LOG_STEPS else None
        idle_s = self.note_idle(msg.step_id, started)
        launched = self.ahead.pop(msg.step_id, None)  # launched while the step before it ran
        if isinstance(launched, Exception):
            raise launched
        if launched is None:
            batch = self.batch_of(msg, self.tokens_of(msg))
            self.last_step_id = self.last_tokens = None  # until this step has sampled
            launched = overlap.launch(self.stage, batch, msg.step_id) if self.launch_ahead else None
        if launched is not None:
            self.launch_next(launched)
            out = overlap.finish(self.stage, launched)
        else:
            out = self.stage.forward(batch, msg.hidden)
        if out.tokens is not None:
            self.last_step_id, self.last_tokens = msg.step_id, out.tokens
        self.steps_served += 1
        compute_s = time.perf_counter() - started
        self.busy_s += compute_s
        if int(np.sum(msg.lengths)) == len(msg.slots):  # one token a sequence: decode
            self.note_decode(msg.step_id, len(msg.slots), compute_s)
        if LOG_STEPS:  # the misses and PCIe bytes: those of the step this call collected (observe), and its admissions
            misses, h2d = np.subtract(self.cache_counts(), counted)
            log.info("gpu%d step %d: %d tokens, %.2f ms, %.2f ms after the last; %d misses, %.1f MiB over PCIe%s",
                     self.gpu, msg.step_id, int(np.sum(msg.lengths)), 1e3 * compute_s,
                     -1.0 if idle_s is None else 1e3 * idle_s, misses, h2d / MIB, self.pool_figure())
        self.last_step_end_s = time.perf_counter()
        return StepReply(step_id=msg.step_id, generation=self.link.generation, compute_s=compute_s,
                         hidden=out.hidden, tokens=out.tokens,
                         logprobs=out.logprobs, top_ids=out.top_ids, top_logprobs=out.top_logprobs,
                         pending_rows=out.pending_rows)

    def step_pool(self):
        """The stage's device step pool (cuda), or None."""
        return getattr(getattr(self.stage, "ops", None), "device_pool", None)

    def pool_figure(self) -> str:
        """The step pool's MiB, for the step line (where a long step grows it: not charged to the cache)."""
        pool = self.step_pool()
        return "" if pool is None else (f", step pool {pool.allocated_bytes / MIB:.1f} MiB "
                                        f"({pool.beyond_loan_bytes / MIB:.1f} allocated beyond a loan so far)")

    def cache_counts(self) -> tuple[int, int]:
        """The expert cache's misses and bytes over PCIe so far (0, 0 where every expert is resident)."""
        experts = self.stage.experts
        return getattr(experts, "misses", 0), getattr(experts, "h2d_bytes", 0)

    def note_idle(self, step_id: int, started: float) -> float | None:
        """The time from the last step's end to this one's start (None: the first step), logged where it
        is long: the broker's time, or an INFO / VRAM served between (logged on their own when slow)."""
        idle_s = None if self.last_step_end_s is None else started - self.last_step_end_s
        if idle_s is not None and IDLE_LOGGED_S[0] < idle_s < IDLE_LOGGED_S[1]:
            log.info("gpu%d: step %d came %.1f ms after the last one ended", self.gpu, step_id, 1e3 * idle_s)
        return idle_s

    def note_decode(self, step_id: int, batch: int, compute_s: float) -> None:
        """Log a decode step far slower than the recent ones: where a text stream's gap came from."""
        recent = self.recent_decode_s
        if len(recent) >= 8:
            typical = statistics.median(recent)
            if compute_s > max(SLOW_DECODE_FACTOR * typical, SLOW_DECODE_MIN_S):
                log.info("gpu%d: decode step %d took %.1f ms (batch %d; median of the last %d: %.1f ms)", self.gpu,
                         step_id, 1e3 * compute_s, batch, len(recent), 1e3 * typical)
        recent.append(compute_s)

    def launch_next(self, running: overlap.Launched) -> None:
        """While ``running`` computes, wait for the broker's look-ahead step after it and launch that
        too (its tokens are the ids ``running`` samples, copied on the device). The STEP stays in the
        inbox: the loop answers it in turn, from ``ahead``; an error launching it is its answer."""
        while (following := self.link.peek(timeout_s=PEEK_S)) is None:
            if running.is_done():
                return
        if not (isinstance(following, Step) and following.tokens_from == running.step_id and following.tokens_rows is None
                and following.held_row is None and len(following.slots) == running.batch.num_seqs
                and following.step_id not in self.ahead):
            return
        try:
            batch = self.batch_of(following, np.zeros(len(following.slots), np.int32))  # the ids come on the device
            launched = overlap.launch(self.stage, batch, following.step_id, after=running)
        except Exception as e:  # noqa: BLE001 - reported as the answer to that step
            launched = e
        if launched is not None:
            self.ahead[following.step_id] = launched
            self.steps_launched_ahead += not isinstance(launched, Exception)

    def batch_of(self, msg: Step, tokens) -> StepBatch:
        images = {"embeds": msg.embeds, "embed_rows": msg.embed_rows} if msg.embeds is not None else {}
        images.update(rope_positions=msg.rope_positions, deepstack=msg.deepstack, deepstack_rows=msg.deepstack_rows)
        if msg.held_row is not None:  # the chunk this stage holds: its rows (and ids) as it kept them
            tokens, images = spanning_chunk.with_held_feed(self.stage, msg, tokens, images)
        return StepBatch(slots=msg.slots, starts=msg.starts, lengths=msg.lengths, tokens=tokens,
                         temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, u=msg.u,
                         top_logprobs=msg.top_logprobs, logprob_rows=msg.logprob_rows, logit_rules=logit_rules_of(msg),
                         **images, **masks_of(msg))

    def tokens_of(self, msg: Step):
        """The step's token ids: its own, or (``tokens_from``) those this stage sampled in the step it
        names, which must be the last one this worker ran, with as many rows (or, with
        ``tokens_rows``, those rows of it)."""
        if msg.tokens_from is None:
            return msg.tokens
        if not (self.stage.is_first and self.stage.is_last):
            raise ValueError(f"step {msg.step_id} takes its tokens from step {msg.tokens_from}, but this stage "
                             "is not the whole model (only such a stage samples the ids it embeds)")
        rows = msg.tokens_rows
        if msg.tokens_from != self.last_step_id or (len(self.last_tokens) != len(msg.slots) if rows is None
                                                    else len(rows) and int(rows.max()) >= len(self.last_tokens)):
            raise ValueError(f"step {msg.step_id} takes its tokens from step {msg.tokens_from}, which is not the last "
                             f"step this worker sampled ({self.last_step_id}) or has another batch size")
        return self.last_tokens if rows is None else self.last_tokens[rows]

    def vram(self, msg: Vram) -> VramReply:
        experts = self.stage.experts
        if not hasattr(experts, "resize"):
            return VramReply(id=msg.id, reserve_mib=0, free_mib=0, expert_slots=0, expert_cache_mib=0,
                             error="this worker's expert cache is not elastic")
        started = time.perf_counter()
        spanning_chunk.return_loan(self.stage)  # a resize (or query) needs the cache whole; the chunk lends again
        # the step pool's idle buffers go back before the free VRAM is read: a long step's (an image's prompt
        # grew it by ~470 MiB on the H200) would stay charged to the budget, and the regrow to the start-up
        # size overshoot it by as much, which the next hand-back's first requests then paid for
        released = 0 if msg.query else self.stage.ops.release_scratch()
        scratch_s = time.perf_counter() - started
        beside = self.step_beside() if msg.reserve_mib is not None and not msg.query and self.handback_beside else None
        peek_s = time.perf_counter() - started - scratch_s
        reply = VramReply(id=msg.id, **experts.resize(msg.reserve_mib, query=msg.query, beside=beside))
        if not msg.query and self.stage.scratch_choices is not None:
            # the room beside the cache is what a reserve hands out (the vision worker's): while one
            # holds, long steps borrow from the cache again instead of allocating there
            measured, wide = self.stage.scratch_choices
            self.stage.scratch = wide if msg.reserve_mib is None else measured
            if msg.reserve_mib is not None and RESERVE_SCRATCH == "beside":  # the room the reserve leaves
                spare = int(reply.free_mib * MIB) - int(msg.reserve_mib * MIB) - CUDA_HEADROOM_BYTES
                self.stage.scratch = widened(measured, spare, image_step_tokens(wide.tokens))
        self.keep_reserve_figures(msg, reply)
        if not msg.query:  # a hand-back step holds every text stream for this long
            split = {**getattr(experts, "last_resize", {}), "scratch_s": scratch_s, "peek_s": peek_s}
            parts = "".join(f", {name} {1e3 * split[key]:.1f}" for key, name in RESIZE_PARTS if key in split)
            if split.get("beside"):
                parts += ", the next step launched beside"
            log.info("gpu%d VRAM %s: %d expert slots, %.1f ms (%.1f waiting for admissions, %+d segments, %d experts "
                     "moved down%s)%s", self.gpu, msg.reserve_mib, reply.expert_slots, 1e3 * (time.perf_counter() - started),
                     1e3 * split.get("admissions_wait_s", 0.0), split.get("segments", 0), split.get("moved", 0), parts,
                     self.room_figures(split.get("free_before_mib"), reply.free_mib, released))
        return reply

    def step_beside(self):
        """For a reserve: the launch of the decode step queued behind it (the broker sends its next step
        right after a hand-back request, which takes its ids from the last step here), as a callable the
        cache calls once the leaving slots are out of service (True: launched); None where the next
        message is not such a step. The STEP stays in the inbox: the loop answers it in turn, from
        ``ahead``; an error launching it is its answer."""
        following = self.link.peek(timeout_s=PEEK_S)
        if not (isinstance(following, Step) and following.tokens_from is not None
                and following.tokens_from == self.last_step_id and following.tokens_rows is None
                and following.held_row is None and following.step_id not in self.ahead
                and self.last_tokens is not None and len(following.slots) == len(self.last_tokens)):
            return None

        def launch() -> bool:
            try:
                batch = self.batch_of(following, self.tokens_of(following))
                launched = overlap.launch(self.stage, batch, following.step_id)
            except Exception as e:  # noqa: BLE001 - reported as the answer to that step
                launched = e
            if launched is None:
                return False  # not a step that launches (no graph for it): it runs in turn, after the unmap
            self.ahead[following.step_id] = launched
            self.last_step_id = self.last_tokens = None  # until that step has sampled, as in _step
            self.steps_launched_beside += not isinstance(launched, Exception)
            return not isinstance(launched, Exception)
        return launch

    def room_figures(self, free_before_mib: float | None, free_after_mib: float, released_bytes: int) -> str:
        """A VRAM step's free MiB before and after it, the step pool's MiB and what of it went back first
        (twenty-fifth session: the pool an image's prompt grew, kept, made the first hand-back requests
        release 2-3x what they asked)."""
        parts = [] if free_before_mib is None else [f"free {free_before_mib:.1f} -> {free_after_mib:.1f} MiB"]  # a regrow: none
        if (pool := self.step_pool()) is not None:
            parts.append(f"step pool {pool.allocated_bytes / MIB:.1f} MiB ({released_bytes / MIB:.1f} released first)")
        return "; " + ", ".join(parts) if parts else ""

    def keep_reserve_figures(self, msg: Vram, reply: VramReply) -> None:
        """After a VRAM request: while a reserve holds, what INFO gives in place of the driver's figures."""
        held = self.reserve_figures is not None if msg.query else msg.reserve_mib is not None
        if not held or INFO_AT_RESERVE == "driver" or reply.error or self.stage.ops.name != "cuda":
            self.reserve_figures = None
            return
        at = self.reserve_figures["at"] if msg.query else time.monotonic()  # a query refreshes, not extends
        figures = {"report": {k: getattr(reply, k) for k in ("reserve_mib", "free_mib", "expert_slots", "expert_cache_mib")}}
        self.reserve_figures = {**figures, **self.driver_figures(), "at": at}

    def driver_figures(self) -> dict:
        """What an INFO asks the driver for: the most the cache could free, the device's free MiB (cuda)."""
        figures = {}
        if hasattr(self.stage.experts, "resize"):  # elastic: what the vision worker could be given here
            figures["max_free_mib"] = round(max_free_bytes(self.stage.experts) / MIB, 1)
        if self.stage.ops.name == "cuda":  # the driver's own figure (free_mib is within the budget, if any)
            from moebus.cuda.memory.vmm import device_memory_info

            asked = time.perf_counter()
            figures["device_free_mib"] = round(device_memory_info()[0] / MIB, 1)
            self.driver_info_s = time.perf_counter() - asked
        return figures

    def stats(self) -> dict:
        stage = self.stage  # prompt chunks that spanned steps (workers/spanning_chunk.py)
        stats = {"gpu": self.gpu, "steps": self.steps_served, "steps_launched_ahead": self.steps_launched_ahead,
                 "steps_launched_beside": self.steps_launched_beside,
                 "chunks_spanned": stage.chunks_spanned, "chunk_steps": stage.chunk_steps,
                 "chunks_dropped": stage.chunks_dropped,
                 "busy_s": self.busy_s,
                 "dropped_messages": self.link.dropped_messages, "attention_dtype": self.stage.attention_dtype,
                 "lm_head_dtype": self.stage.lm_head_dtype if self.stage.is_last else None}  # only the last holds it
        kept = self.reserve_figures  # a reserve was just set: the last VRAM request's figures, no driver call
        if kept is not None and time.monotonic() - kept["at"] > RESERVE_KEPT_S:
            kept = self.reserve_figures = None
        if hasattr(self.stage.experts, "stats"):
            stats.update(self.stage.experts.stats(**({"report": kept["report"]} if kept else {})))
        stats.update({k: v for k, v in (kept or self.driver_figures()).items() if k not in ("report", "at")})
        if self.stage.ops.name == "cuda":  # decode steps replayed as CUDA graphs, by batch size
            stats.update(cuda_graphs=self.stage.use_graphs, graph_batches=sorted({k[0] for k in self.stage.graphs}),
                         graph_captures=self.stage.graph_captures, eager_short_steps=self.stage.eager_short_steps)
        if hasattr(self.stage.experts, "residency"):  # the dashboard's layers x experts map
            stats["residency"] = self.stage.experts.residency()
        return stats


def run_worker(settings, model_dir: str, gpu: int, layers: range, connect: str, device: str) -> int:
    """Load the stage, register, serve. ``device`` is 'cpu' or 'cuda' (already resolved)."""
    link = BrokerLink(connect, f"gpu{gpu}", settings.broker.heartbeat_s, settings.broker.heartbeat_liveness,
                      server_key=settings.broker.curve_public_key, keys=transport.client_keys(settings.broker))  # a bad address fails before loading
    stage = load_stage(settings, model_dir, gpu, layers, device)
    warm_decode_graphs(stage, settings.max_batch, f"gpu{gpu}")
    warm_prompt_path(stage, settings.max_batch, f"gpu{gpu}")
    trace = step_trace.from_env(gpu, ROUTED_MAX_TOKENS) if device == "cuda" else None  # before READY
    link.start(Ready(gpu=gpu, generation=link.generation, layers=(layers.start, layers.stop), device=device,
                     expert_slots=stage.experts.num_slots, pid=os.getpid(), model=Path(model_dir).name,
                     max_batch=settings.max_batch, max_context=settings.max_context))
    log.info("gpu%d ready: layers [%d, %d) on %s, %s", gpu, layers.start, layers.stop, device,
             stage.experts.report())
    log.info("gpu%d kernels: %d loaded from the disk cache, %d compiled%s", gpu, *disk_cache_counts(),
             step_watch.compiled_names())
    gc_pauses.watch(log, f"gpu{gpu}")  # MOEBUS_GC_FREEZE, MOEBUS_LOG_GC_MS: a step's pause no kernel explains
    watch = step_watch.from_env(f"gpu{gpu}") if device == "cuda" else None  # MOEBUS_STEP_STACKS_S
    try:
        return GpuWorker(stage, link, gpu, settings.launch_ahead, trace, watch).serve()
    finally:
        if watch is not None:
            watch.close()
        link.close()


def warm_decode_graphs(stage: Stage, max_batch: int, label: str) -> None:
    """Capture the decode graphs before READY (graph_warmup.py), so that a batch size seen for the
    first time while serving does not stall every stream for its capture and compiles."""
    if not stage.use_graphs:
        return
    started = time.perf_counter()
    count = warm_graphs(stage, warm_sizes(max_batch), progress=lambda it: tqdm(it, desc=f"{label}: decode graphs",
                                                                              unit="batch size"))
    log.info("%s: %d decode graphs captured in %.1f s", label, count, time.perf_counter() - started)


def warm_prompt_path(stage: Stage, max_batch: int, label: str) -> None:
    """On cuda (MOEBUS_WARM_PROMPT_STEPS): the short prompt steps' kernel variants before READY
    (graph_warmup.warm_prompt_steps), so that a text stream's first prompt step does not compile them."""
    if not WARM_PROMPT_STEPS or stage.ops.name != "cuda":
        return
    from moebus.cuda.kernels.linear import MAX_TOKENS

    started, kernels_at = time.perf_counter(), disk_cache_counts()
    sizes = warm_prompt_sizes(max_batch, MAX_TOKENS)
    ran = warm_prompt_steps(stage, sizes)
    log.info("%s: %d prompt steps of %s tokens run in %.2f s (kernels: %d loaded, %d compiled)", label, ran,
             ", ".join(map(str, sizes)), time.perf_counter() - started,
             *(now - then for now, then in zip(disk_cache_counts(), kernels_at)))


def warm_spanning_chunk(stage: Stage, settings, label: str) -> None:
    """On cuda, a prompt chunk that spans steps run once at start (spanning_chunk.warm), over the
    sizing's small cache and before the cache takes the free VRAM, its buffers then given back: the
    first image's chunk beside text streams would otherwise compile or load its kernels there."""
    if stage.ops.name != "cuda" or settings.max_prefill_copy_mib_beside_decode <= 0:
        return
    started = time.perf_counter()
    if not spanning_chunk.warm(stage, ROUTED_MAX_TOKENS + 1):
        return
    stage.ops.release_scratch()
    log.info("%s: the spanning chunk's kernels warmed in %.2f s (%d grouped products)", label,
             time.perf_counter() - started, stage.warmed_products)


def load_stage(settings, model_dir: str, gpu: int, layers: range, device: str) -> Stage:
    """The stage on its device. A checkpoint the loader refuses raises CheckpointError; a stage that
    does not fit its GPU raises ConfigError: neither start can succeed by trying again."""
    if device == "cuda" and settings.segment_mib % (GRANULARITY // MIB):
        raise ConfigError(f"segment_mib {settings.segment_mib}: on cuda a segment is whole 2 MiB granules (the "
                          f"driver's allocation granularity); use an even number of MiB, or 0 (two slots a segment)")
    ckpt = Checkpoint(model_dir)
    backend = make_backend(device)
    budget = cuda_budget(settings, gpu) if device == "cuda" else None  # after the context, before the weights
    label = f"gpu{gpu} layers {layers.start}-{layers.stop - 1}"
    try:
        stage = Stage(ckpt, layers, backend, num_slots=settings.max_batch, max_context=settings.max_context,
                      kv_dtype=resolve_kv_dtype(settings.kv_dtype, device), attention_dtype=settings.attention.dtype,
                      lm_head_dtype=settings.lm_head.dtype,
                      experts=lambda st: make_cache(settings, ckpt, st, gpu, label, budget),
                      progress=lambda it: tqdm(it, desc=f"{label}: dense weights", unit="layer"))
    except Exception as e:  # noqa: BLE001 - only running out of device memory is re-read here
        if not is_out_of_memory(e):
            raise
        raise ConfigError(f"gpu{gpu} ({label}) does not fit: {e}; give it fewer layers (layer_split), a smaller "
                          f"max_batch / max_context / max_step_tokens, or more memory") from e
    stage.chunk_copy_budget_bytes = int(settings.max_prefill_copy_mib_beside_decode * MIB)
    stage.chunk_time_share = spanning_chunk.TIME_SHARE if device == "cuda" else 0.0
    stage.chunk_overlap = chunk_rows.OVERLAP and device == "cuda"
    return stage


def cuda_budget(settings, gpu: int) -> DeviceBudget | None:
    """This GPU's VRAM budget (gpu_memory_mib / gpu_memory_utilization), from the driver's figures."""
    from moebus.cuda.memory.vmm import device_memory_info

    limit = budget_bytes(settings, gpu, device_memory_info()[1])
    if limit is None:
        return None
    budget = DeviceBudget(limit, device_memory_info)
    log.info("gpu%d: a budget of %.0f MiB (%.0f MiB free on the device now)", gpu, budget.budget_bytes / MIB,
             budget.baseline_free / MIB)
    return budget


def make_cache(settings, ckpt, stage: Stage, gpu: int, label: str, budget: DeviceBudget | None = None):
    """The stage's elastic expert cache, sized from what VRAM is left after the dense weights, the KV
    cache and the step scratch measured by a warm-up (see cache_sizing.py); the warm-up runs over a
    cache of one expert group, which then gives its memory back. ``budget``: on cuda, the GPU as
    moebus may use it (its free memory, and the cache's from then on)."""
    ledger = None
    if stage.ops.name == "cpu":  # charge the emulated GPU as VRAM would be charged
        ledger = emulated_gpu(settings, gpu)
        kv_bytes = sum(a.nbytes for a in stage.kv.k + stage.kv.v)
        ledger.allocate(stage_dense_bytes(ckpt, stage.layer_range, stage.is_first, stage.is_last, kv_bytes,
                                          stage.lm_head_dtype, stage.attention_dtype), "dense")
    stage.experts = build_expert_cache(ckpt, stage.layer_range, stage.ops, capacity_bytes=0, gpu=ledger, preload=False,
                                       experts_dtype=settings.experts.dtype,
                                       progress=lambda it: tqdm(it, desc=f"{label}: experts to host store", unit="layer"))
    scratch = measure_scratch(stage, settings.max_batch, settings.max_step_tokens)
    warm_spanning_chunk(stage, settings, label)
    stage.experts.arena.close()
    store, stage.experts = stage.experts.store, None
    if ledger is not None:
        ledger.allocate(scratch.standing_bytes, "scratch")
        free, _ = ledger.memory_info()
        scratch_to_keep = 0
    else:
        from moebus.cuda.memory.vmm import device_memory_info

        free, _ = budget.memory_info() if budget else device_memory_info()
        scratch_to_keep = scratch.standing_bytes + CUDA_HEADROOM_BYTES
        if budget and free < scratch_to_keep:
            raise ConfigError(f"gpu{gpu}: gpu_memory_mib / gpu_memory_utilization leave {free / MIB:.0f} MiB after the "
                              f"dense weights and KV cache, less than the {scratch_to_keep / MIB:.0f} MiB of step "
                              f"scratch and headroom: raise the budget, or lower max_batch / max_context")
    reserve = reserve_for(settings, gpu)
    cache = build_expert_cache(ckpt, stage.layer_range, stage.ops,
                               capacity_bytes=startup_capacity_bytes(free, reserve, scratch_to_keep),
                               segment_bytes=settings.segment_mib * MIB, elastic=settings.vram_elastic, gpu=ledger,
                               startup_reserve_mib=reserve, store=store, prefetch_slots=settings.experts.prefetch_slots)
    stage.scratch = scratch  # steps longer than the measured one borrow from the cache
    if ledger is None:  # unless the GPU has room beyond a cache of every expert: then they use that
        spare = free - int(reserve * MIB) - scratch_to_keep - cache.arena.mapped_bytes
        stage.scratch = widened(scratch, spare, settings.max_step_tokens)
        stage.scratch_choices = (scratch, stage.scratch)  # while a VRAM reserve holds: the measured one
        if stage.scratch is not scratch:
            log.info("gpu%d: steps of up to %d tokens take their scratch beside the cache (%.0f MiB spare)", gpu,
                     stage.scratch.tokens, spare / MIB)
    if budget is not None:  # reserves, reports and max_free_mib count within the budget, not the whole GPU
        cache.arena.memory_info = budget.memory_info
    return cache
