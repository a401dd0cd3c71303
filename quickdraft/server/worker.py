"""One thread owns the engine; requests wait for it in a bounded queue and get their tokens back on their
own asyncio queue. Up to `parallel` requests generate at once, stepped together (engine.Batch): each step is one
target pass over all of them, and a newcomer's prompt is prefilled in the rows the others leave. Which waiting request
starts next is the scheduler's choice (engine/scheduler.py: the shortest expected prefill first, with ageing). A
request that is cancelled (client gone) ends at the next step, without disturbing the others.

The thread that runs the engine is the one that made it (EngineWorker's constructor): PyTorch's CPU thread
pool (OpenMP) belongs to the first thread that runs parallel work. Another thread that runs ops while that pool
lives gets a second pool, and with no core to spare its threads may not spin-wait: every op then pays a sleep
and a wake-up (on 2 cores a small operator then takes about ten times as long).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from quickdraft.api import LLM
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.engine import Batch, Halt, Timings
from quickdraft.errors import QuickdraftError
from quickdraft.constraint import Constraint, ConstraintError
from quickdraft.server.metrics import Metrics
from quickdraft.server.protocol import say
from quickdraft.server.stops import StopMatcher
from quickdraft.speculative.stats import SpeculationStats

log = logging.getLogger("quickdraft.server")


@dataclass
class Piece:
    text: str
    logprobs: list[dict] | None = None  # with logprobs asked: an entry per token since the last piece
    trace: list[dict] | None = None  # with speculation_trace asked: likewise, each token's origin (_traced)


@dataclass
class Done:
    finish_reason: str  # stop | length | cancelled
    completion_n: int
    timings: Timings
    stats: SpeculationStats
    logprobs: list[dict] | None = None  # entries of tokens whose text never came (held back, then cut)
    trace: list[dict] | None = None


@dataclass
class Cancelled:
    """The job ended without running, or its client went away: every job's events end with Done, Failed or this, so
    no handler waits for an end that never comes."""


@dataclass
class Failed:
    message: str
    status: int = 500  # 400: the request's own fault (a constraint that failed while generating)
    param: str | None = None


class Ticket:
    """A request's place in the queue, held from its admission (once its constraint has compiled) until the engine
    takes it up, or until it is given up: a request whose client has gone frees its place at once."""

    def __init__(self, worker: "EngineWorker"):
        self.worker, self.released = worker, False

    def release(self) -> None:
        self.worker._release(self)


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    speculation: SpeculationConfig | None
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    constraint: Constraint | None = None
    ticket: Ticket | None = None  # its place in the queue (EngineWorker.admit)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    halt: Halt = field(default_factory=Halt)
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when the engine took it up
    trace: bool = False  # hand each token's origin over with the text (Piece.trace)
    reuse: bool = True  # reuse what a kept slot holds of the prompt (the request's cache_prompt)
    scope: object = None  # whose history it drafts from and adds to (the request's `user`; None: the server's)

    def cancel(self) -> None:
        if self.halt.reason is None:
            self.halt.reason = "cancelled"
        if self.ticket is not None:  # a waiting job's place goes to the next client
            self.ticket.release()

    @property
    def cancelled(self) -> bool:
        return self.halt.reason == "cancelled"

    def put(self, item) -> None:
        """Hand an item to the request's coroutine (called from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancel()


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        self.retry_after_s = retry_after_s


class EngineWorker:
    def __init__(self, make_llm: Callable[[], LLM], max_queue: int, metrics: Metrics, parallel: int = 1):
        """Load the model (make_llm: an api.LLM) on the worker's own thread, which then serves with its engine
        (see the module's note); return once it is loaded. What make_llm raises is raised here. parallel: how many
        requests generate at once (engine.Batch; at most the engine's cache slots)."""
        self.metrics = metrics
        self.max_queue = max_queue
        self.parallel = parallel
        self.pending: queue.Queue[Job | None] = queue.Queue()  # bounded by admission: see admit
        self.waiting: list[Job] = []  # taken off `pending` by the engine thread, not yet started (its own list)
        self.held = 0  # places taken: requests waiting for the engine
        self._places = threading.Lock()
        self.running: dict[int, Stream] = {}  # the jobs generating now, by their sequence's id
        self.batch: Batch | None = None
        self.mean_request_s = 5.0  # moving average, for Retry-After
        made = threading.Event()
        failed: list[BaseException] = []

        def own_thread() -> None:
            try:
                self.llm = make_llm()
                self.engine = self.llm.engine
            except BaseException as e:  # noqa: BLE001 -- handed to the caller, on its thread
                failed.append(e)
                return
            finally:
                made.set()
            self._run()

        self.thread = threading.Thread(target=own_thread, name="quickdraft-engine", daemon=True)
        self.thread.start()
        made.wait()
        if failed:
            raise failed[0]

    def admit(self) -> Ticket:
        """A place in the queue (QueueFull when all max_queue are taken), for a request ready to run."""
        with self._places:
            self.check_room()
            self.held += 1
        self.metrics.waiting.set(self.held)
        return Ticket(self)

    def check_room(self) -> None:
        """QueueFull when every place is taken: a cheap answer before work (a constraint's compile) that admit
        would then refuse."""
        if self.held >= self.max_queue:
            raise QueueFull(max(1, round((self.held + 1) * self.mean_request_s)))

    def _release(self, ticket: Ticket) -> None:
        with self._places:
            if ticket.released:
                return
            ticket.released = True
            self.held -= 1
        self.metrics.waiting.set(self.held)

    def submit(self, job: Job) -> None:
        """Queue a job for the engine, in the place its ticket holds (one is taken now if it has none)."""
        if job.ticket is None:
            job.ticket = self.admit()
        self.pending.put(job)

    def stop(self) -> None:
        """Cancel everything and end the thread (server shutdown)."""
        while True:
            try:
                job = self.pending.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.put(Cancelled())
        for stream in list(self.running.values()):
            stream.job.cancel()
        self.pending.put(None)
        self.thread.join(timeout=30)

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        """Start waiting jobs while the batch has room (the scheduler's choice among them), step every running one
        together, hand each its events; block for a job only while none runs or waits."""
        batch = self.batch = Batch(self.engine, self.parallel)
        stopping = False
        while True:
            stopping = self._collect(block=not batch.active and not self.waiting) or stopping
            if stopping:
                for job in self.waiting:
                    job.cancel()
                    job.put(Cancelled())
                self.waiting.clear()
            while self.waiting and (batch.room() or not batch.active):
                job = self.waiting.pop(self.engine.scheduler.next_admitted(self.waiting, self.engine.slots.held))
                if not batch.room():  # no slot free with nothing running: a bug of ours, said rather than hung
                    job.ticket.release()
                    job.put(Failed("no cache slot is free"))
                    continue
                self._admit(job, batch)
            if not batch.active:
                if stopping:
                    return
                continue
            try:
                batch.step(self._deliver)
            except Exception:  # a bug of ours outside any one sequence: fail what runs, go on serving
                log.exception("a step failed")
                batch.fail(RuntimeError("the engine's step failed"), self._deliver)
            self.metrics.running.set(len(batch.active))
            if batch.last_rows:
                self.metrics.batch_rows.observe(batch.last_rows)

    def _collect(self, block: bool) -> bool:
        """Take every job queued for the engine into `waiting` (waiting for one first where `block`); True once the
        stop was asked for. Jobs whose clients left while they waited end here."""
        stopping = False
        while True:
            try:
                job = self.pending.get(block=block)
            except queue.Empty:
                break
            block = False
            if job is None:
                stopping = True
                continue
            self.waiting.append(job)
        for job in [j for j in self.waiting if j.cancelled]:  # its handler still awaits an end
            self.waiting.remove(job)
            self.metrics.finished.labels("cancelled").inc()
            job.put(Cancelled())
        return stopping

    def _admit(self, job: Job, batch: Batch) -> None:
        job.ticket.release()  # running now: its place in the queue is free
        job.started = time.perf_counter()
        self.metrics.queue_time.observe(job.started - job.submitted)
        if job.cancelled:  # the client left while waiting: its handler still awaits an end
            self.metrics.finished.labels("cancelled").inc()
            job.put(Cancelled())
            return
        try:
            s = batch.add(job.prompt, job.params, job.speculation, job.halt, job.constraint, job.reuse, self._waiting(),
                          job.scope)
        except Exception as e:  # noqa: BLE001 -- the request's (a context the handler did not check): it fails alone
            job.put(Failed(say(e), 400 if isinstance(e, QuickdraftError) else 500))
            return
        self.running[id(s)] = Stream(job, self.engine.target.tokenizer)
        self.metrics.running.set(len(batch.active))

    def _waiting(self) -> list[list[int]]:
        """The prompts of jobs waiting their turn, as many as run at once (their kept slots are left to them:
        Slots.take)."""
        waiting = [job.prompt for job in self.waiting if job.reuse and not job.cancelled]
        return waiting[:self.parallel]

    def _deliver(self, s, item) -> None:
        """A sequence's event (or the exception it failed with), to its job."""
        stream = self.running[id(s)]
        job = stream.job
        if isinstance(item, BaseException):
            del self.running[id(s)]
            if isinstance(item, ConstraintError):  # the request's constraint, not us
                job.put(Failed(str(item), 400, "response_format"))
            else:  # a bug of ours: this request fails, the server goes on
                log.error("generation failed", exc_info=item)
                job.put(Failed(f"generation failed: {type(item).__name__}: {item}"))
            self._ended(job)
            return
        done = stream.push(item)
        if done is not None:
            del self.running[id(s)]
            self.metrics.record_generation(done.finish_reason, done.completion_n, done.timings, done.stats)
            job.put(done)
            self._ended(job)

    def _ended(self, job: Job) -> None:
        now = time.perf_counter()
        self.metrics.e2e.observe(now - job.submitted)
        self.mean_request_s = 0.8 * self.mean_request_s + 0.2 * (now - job.started) / max(self.parallel, 1)


class Stream:
    """A running job's events turned into what its handler gets: text pieces with stop strings matched (a match
    halts the sequence), log-probabilities and origins per token, and Done at the end."""

    def __init__(self, job: Job, tokenizer):
        self.job, self.tokenizer, self.stops, self.n = job, tokenizer, StopMatcher(job.stops), 0
        # entries not yet handed over: log-probabilities and origins of the tokens since the last piece
        self.scored = [] if job.params.logprobs is not None else None
        self.traced = [] if job.trace else None

    def push(self, event) -> Done | None:
        """Hand over what the event completes; the Done (also handed over) once it is the last."""
        job, stops = self.job, self.stops
        if event.token is not None and not stops.matched:
            if self.scored is not None:
                self.scored.append(_entry(self.tokenizer, event))
            if self.traced is not None:
                self.traced.append(_traced(event))
        text = stops.push(event.text)
        if stops.matched and job.halt.reason is None:
            job.halt.reason = "stop"
        if text:
            self._piece(text)
        if event.token is not None:
            self.n += 1
            return None
        tail = stops.flush()
        if tail:
            self._piece(tail)
        return Done(event.finish_reason, self.n, event.timings, event.stats, self.scored or None, self.traced or None)

    def _piece(self, text: str) -> None:
        self.job.put(Piece(text, self.scored, self.traced))
        self.scored, self.traced = _fresh(self.scored), _fresh(self.traced)


def _entry(tokenizer, event) -> dict:
    """A token's log-probabilities as OpenAI gives them: token text, its UTF-8 bytes, and the alternatives."""

    def one(token: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw), "id": token}

    return {**one(event.token, event.logprob),
            "top_logprobs": [one(t, lp) for t, lp in event.top_logprobs or []]}


def _fresh(entries: list | None) -> list | None:
    return [] if entries is not None else None


def _traced(event) -> dict:
    """A token's origin as the chunks carry it: its text as decoded (the message's text is authoritative: a stop
    string is cut from it), which drafter proposed it ("draft", "ngram"; "target": the target's own), the step
    that gave it (0: the prefill, then one per plain step or round) and what that step drafted (k)."""
    return {"text": event.text, "source": event.source, "step": event.step, "k": event.k}
