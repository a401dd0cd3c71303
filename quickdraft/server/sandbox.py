"""Constraints from requests are compiled in a child process first, so that none can take the server down.

llguidance is a native library: a grammar that overflows its stack kills the process that compiles it (a
segfault: nothing to catch), and its GBNF reader is pure Python, quadratic in the rules, holding the GIL. Bounds
(grammar.check_bounds) refuse what is far beyond any real constraint; this sandbox is what stands when a bound is
not enough. A child process (`python -m quickdraft.server.sandbox`, no PyTorch: llguidance and the tokenizer
only) compiles each constraint and walks its matcher through its first tokens (grammar.trial), one constraint at
a time. The server then builds its own matcher from the compiled text the child sends back, which takes
milliseconds. A child that crashes or runs past the timeout is killed, and a new one is started for the next
request. Its memory is capped (RLIMIT_AS), so a runaway compile fails there too. A compile whose client has gone
away runs on in the sandbox's own task, within its limit, and its outcome is kept for the next client (a child
killed for it would cost a restart and keep nothing). When the sandbox closes, every child is killed, whatever it
is doing, starting included.

Why a process and not a thread: a thread shares the server's stack space and GIL, and nothing can stop a thread
running native code. Why long-lived children: building llguidance's view of a large vocabulary takes about as
long as a compile can, so each child builds it once.

Lanes. One child for everyone let three compiles that run to the time limit hold a valid one for 30 s. Here LANES
children take first tries of at most FIRST_TRY_S (a real constraint needs milliseconds; a loaded machine, a
second). A compile that needs longer is killed there (its lane restarts) and tried again, for the rest of
TIMEOUT_S, on the slow lane, one compile at a time. Compiles waiting for a first try get the shared lanes shortest
constraint first (its length is all anyone knows before compiling, and a bomb is long): a constraint waits for
the first tries under way (about FIRST_TRY_S and a restart at most) and for constraints no longer than itself,
never behind longer bombs however many. At most MAX_WAITING wait: one more displaces the longest waiting (a 503
for it), or is refused itself when none is longer. The slow lane has its own budget, MAX_SLOW compiles on it or
waiting for it; a compile that needs it beyond that is refused (a 503, not kept), so bombs never take the first
tries' places. vLLM and SGLang compile on a thread pool beside the scheduler, with no time limit; llama-server
compiles on the thread that serves. Compiles wait for a lane, not in the engine's queue (server/responses.py):
plain requests never wait for them. Outcomes are kept (CACHE_SIZE, by the constraint's text): agents send the
same tool schemas with every turn, and a bomb sent again is refused at once (a time-out or a crash for RETRY_S
only: load may have caused it).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass

from quickdraft import grammar as grammars
from quickdraft.errors import QuickdraftError
from quickdraft.grammar import Grammar

TIMEOUT_S = 10.0  # a constraint compiles in milliseconds; this is for the ones that never would
FIRST_TRY_S = 2.0  # on a shared lane (see the module's note); what needs longer goes on to the slow lane
LANES = 2
MAX_WAITING = 32  # compiles waiting for a first try on a shared lane
MAX_SLOW = 4  # compiles on the slow lane or waiting for it
CACHE_SIZE = 256  # outcomes kept of each kind: constraints that compiled, and constraints refused
RETRY_S = 60.0  # a time-out or a crash is kept this long only: load, not the constraint, may have caused it
MEMORY_BYTES = 4 << 30  # each child's address space
READY_TIMEOUT_S = 120.0  # building the vocabulary's view, once per child


class CompilerUnavailable(Exception):
    """The compiler cannot take a constraint now (its child did not start): the request may retry later (a 503,
    not the client's fault)."""


class CompilerBusy(CompilerUnavailable):
    """Too many compiles are waiting for a lane."""


class _TooSlow(Exception):
    """A compile ran past its time on a lane (the child was killed)."""


@dataclass(frozen=True)
class _Outcome:
    """What compiling a constraint gave: its llguidance text (ok), or why it was refused."""

    ok: bool
    text: str
    lasting: bool = True  # False: a time-out or a crash, which a loaded machine can cause (kept RETRY_S only)


class GrammarSandbox:
    """Compiles request constraints in child processes (see the module's note); `compile` is a coroutine."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], timeout_s: float = TIMEOUT_S,
                 bounds: bool = True, lanes: int = LANES, first_try_s: float = FIRST_TRY_S, max_slow: int = MAX_SLOW):
        """bounds False lets constraints beyond grammar.check_bounds reach the child (tests of the isolation)."""
        self.tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, sorted(eos_ids)
        self.timeout_s, self.bounds, self.first_try_s = timeout_s, bounds, first_try_s
        self.lanes = [_Lane(self) for _ in range(lanes)]
        self.turns = _Turns(self.lanes, MAX_WAITING)
        self.slow = _Lane(self)  # for what needs longer than a first try
        self.slow_lock, self.max_slow, self.on_slow = asyncio.Lock(), max_slow, 0
        self.compiling: dict[tuple[str, str], asyncio.Task] = {}  # by constraint: compiles under way or waiting
        self.restarts = 0  # children started
        # outcomes by constraint, apart so that refusals (what a flood of bombs leaves) never evict what compiled:
        # compiled ones least recently used first; refused ones oldest first, with when they expire (inf: never)
        self.kept: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.refused: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self.clock = time.monotonic

    async def compile(self, grammar: Grammar) -> str:
        """The constraint as llguidance text, checked by a child: QuickdraftError (the client's fault) if it is
        out of bounds, invalid, crashes the compiler or takes longer than the timeout; CompilerUnavailable (not the
        client's fault: a 503) when too many compiles wait or the compiler does not start."""
        if self.bounds:
            grammars.check_bounds(grammar)  # cheap, and spares the children the obvious cases
        key = (grammar.kind, grammar.text)
        outcome = self._known(key)
        if outcome is None:
            task = self.compiling.get(key) or self._begin(key, grammar)
            # a client that goes away leaves the compile to finish within its limit, its outcome kept for the next
            # one; killing the child instead would cost a restart and keep nothing
            outcome = await asyncio.shield(task)
        if not outcome.ok:
            raise QuickdraftError(outcome.text)
        return outcome.text

    def _known(self, key: tuple[str, str]) -> _Outcome | None:
        """The outcome kept for a constraint, if any. A refusal does not move up: bombs sent again and again do
        not keep their place."""
        if key in self.kept:
            self.kept.move_to_end(key)
            return _Outcome(True, self.kept[key])
        why, until = self.refused.get(key, (None, 0.0))
        if why is None or self.clock() >= until:
            self.refused.pop(key, None)
            return None
        return _Outcome(False, why)

    def _keep(self, key: tuple[str, str], outcome: _Outcome) -> None:
        if outcome.ok:
            self.kept[key] = outcome.text
        else:
            self.refused[key] = outcome.text, math.inf if outcome.lasting else self.clock() + RETRY_S
        for kept in (self.kept, self.refused):
            while len(kept) > CACHE_SIZE:
                kept.popitem(last=False)

    def _begin(self, key: tuple[str, str], grammar: Grammar) -> asyncio.Task:
        """Compile in a task of the sandbox's own (one per constraint, however many requests ask for it)."""
        turn = self.turns.ask(len(grammar.text))  # CompilerBusy when too many wait
        task = asyncio.ensure_future(self._compile(grammar, turn))
        self.compiling[key] = task
        task.add_done_callback(functools.partial(self._finished, key))
        return task

    def _finished(self, key: tuple[str, str], task: asyncio.Task) -> None:
        del self.compiling[key]
        if task.cancelled() or task.exception() is not None:  # closed, or the compiler did not start: not kept
            return
        self._keep(key, task.result())

    async def _compile(self, grammar: Grammar, turn: asyncio.Future) -> _Outcome:
        """A first try on a shared lane (turn: one to come), then the rest of the time on the slow lane."""
        first = min(self.first_try_s, self.timeout_s)
        lane = await self.turns.take(turn)
        try:
            return await lane.outcome(grammar, first)
        except _TooSlow:
            if first >= self.timeout_s:
                return _late(grammar, self.timeout_s)
        finally:
            self.turns.give(lane)
        return await self._slow(grammar, self.timeout_s - first)

    async def _slow(self, grammar: Grammar, timeout_s: float) -> _Outcome:
        """The slow lane, one compile at a time, within its own budget (CompilerBusy beyond it)."""
        if self.on_slow >= self.max_slow:
            raise CompilerBusy(f"the server is busy: {self.on_slow} constraints that need more than "
                               f"{self.first_try_s:g} s are waiting for the grammar compiler")
        self.on_slow += 1
        try:
            async with self.slow_lock:
                return await self.slow.outcome(grammar, timeout_s)
        except _TooSlow:
            return _late(grammar, self.timeout_s)
        finally:
            self.on_slow -= 1

    async def start(self) -> None:
        """Start the shared lanes' children now (the first constrained requests would otherwise wait for them)."""
        await asyncio.gather(*(lane.ready() for lane in self.lanes))

    async def close(self) -> None:
        """Cancel every compile (a child starting or compiling for one is killed), then end the children."""
        compiling = list(self.compiling.values())
        for task in compiling:
            task.cancel()
        await asyncio.gather(*compiling, return_exceptions=True)
        for lane in [*self.lanes, self.slow]:
            await lane.kill()


class _Turns:
    """The shared lanes, handed to waiting compiles shortest constraint first, with at most `limit` waiting (see
    the module's note)."""

    def __init__(self, lanes: list, limit: int):
        self.free, self.limit = list(lanes), limit
        self.waiting: list[tuple[int, int, asyncio.Future]] = []  # a heap: (size, arrival, the lane to come)
        self.arrivals = itertools.count()

    def ask(self, size: int) -> asyncio.Future:
        """A lane to come (a future); CompilerBusy if `limit` constraints no longer than this one wait."""
        turn = asyncio.get_running_loop().create_future()
        if self.free:
            turn.set_result(self.free.pop())
            return turn
        self.waiting = [w for w in self.waiting if not w[2].done()]  # cancelled ones (the sandbox closed)
        if len(self.waiting) >= self.limit:
            self._displace(size)
        heapq.heapify(self.waiting)
        heapq.heappush(self.waiting, (size, next(self.arrivals), turn))
        return turn

    def _displace(self, size: int) -> None:
        longest = max(self.waiting)
        busy = f"the server is busy: {len(self.waiting)} constraints are waiting for the grammar compiler"
        if longest[0] <= size:
            raise CompilerBusy(busy)
        self.waiting.remove(longest)
        longest[2].set_exception(CompilerBusy(f"{busy}, and shorter ones came"))

    async def take(self, turn: asyncio.Future):
        try:
            return await turn
        except asyncio.CancelledError:  # the sandbox is closing: a lane handed over meanwhile is handed on
            if turn.done() and not turn.cancelled():
                self.give(turn.result())
            raise

    def give(self, lane) -> None:
        while self.waiting:
            _, _, turn = heapq.heappop(self.waiting)
            if not turn.done():
                turn.set_result(lane)
                return
        self.free.append(lane)


def _late(grammar: Grammar, seconds: float) -> _Outcome:
    return _Outcome(False, f"the {grammar.describe()} did not compile within {seconds:g} s: simplify it", lasting=False)


class _Lane:
    """One child process, compiling one constraint at a time."""

    def __init__(self, sandbox: GrammarSandbox):
        self.sandbox = sandbox
        self.proc: asyncio.subprocess.Process | None = None
        self.starting: asyncio.Lock | None = None

    async def outcome(self, grammar: Grammar, timeout_s: float) -> _Outcome:
        """The constraint's outcome; _TooSlow past timeout_s (the child is killed). CompilerUnavailable if
        the child does not start, QuickdraftError if llguidance does not take the vocabulary: neither is an outcome
        of the constraint, and neither is kept."""
        proc = await self.ready()
        try:
            return await self._ask(proc, grammar, timeout_s)
        except asyncio.CancelledError:  # the sandbox is closing: the child may still be compiling
            await self.kill()
            raise

    async def _ask(self, proc, grammar: Grammar, timeout_s: float) -> _Outcome:
        try:
            proc.stdin.write(json.dumps({"kind": grammar.kind, "text": grammar.text}).encode() + b"\n")
            await proc.stdin.drain()
        except OSError:  # the child died before it read this (killed while idle): its end is read below
            pass
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        except asyncio.TimeoutError:
            await self.kill()
            raise _TooSlow() from None
        if not line:  # the child died compiling it
            self.proc = None
            code = await proc.wait()
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            return _Outcome(False, f"the {grammar.describe()} crashed the grammar compiler (llguidance, {how}): "
                                   "simplify it (fewer rules, less nesting)", lasting=False)
        reply = json.loads(line)
        return _Outcome("ok" in reply, reply.get("ok", reply.get("error")))

    async def ready(self):
        if self.starting is None:
            self.starting = asyncio.Lock()
        async with self.starting:  # one child per lane, however many wait for it
            if self.proc is None or self.proc.returncode is not None:
                self.proc = await self._start()
        return self.proc

    async def _start(self):
        sandbox = self.sandbox
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
            f.write(sandbox.tokenizer_json)
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "quickdraft.server.sandbox", f.name, str(sandbox.vocab_size),
                json.dumps(sandbox.eos_ids), str(MEMORY_BYTES), str(int(sandbox.bounds)),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
                limit=64 << 20)
            line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
        except BaseException as e:  # cancelled too (shutdown): a child no lane owns would live on, never told to end
            await _end(proc)
            if isinstance(e, (OSError, asyncio.TimeoutError)):
                raise CompilerUnavailable(f"structured output is not available now: the grammar compiler did not "
                                          f"start ({e})") from None
            raise
        finally:
            os.unlink(f.name)
        if not line:
            await _end(proc)
            raise CompilerUnavailable("structured output is not available now: the grammar compiler exited at start")
        reply = json.loads(line)
        if "error" in reply:  # this vocabulary is not one llguidance takes: no retry helps
            await _end(proc)
            raise QuickdraftError(reply["error"])
        sandbox.restarts += 1
        return proc

    async def kill(self) -> None:
        proc, self.proc = self.proc, None
        await _end(proc)


async def _end(proc) -> None:
    """Kill a child and reap it; a cancellation meanwhile does not stop the reaping."""
    if proc is not None and proc.returncode is None:
        proc.kill()
        await asyncio.shield(proc.wait())


def _child(tokenizer_path: str, vocab_size: int, eos_ids: list[int], memory: int, bounds: bool) -> None:
    """The child: read the vocabulary, then answer one JSON line per JSON line read."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's: it kills this child
    out = sys.stdout
    try:
        with open(tokenizer_path, encoding="utf-8") as f:
            ll_tok = grammars.ll_tokenizer(f.read(), vocab_size, eos_ids)
    except QuickdraftError as e:
        out.write(json.dumps({"error": str(e)}) + "\n")
        return
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            grammar = Grammar(request["kind"], request["text"])
            text = grammars.to_llguidance(grammar, bounds)
            grammars.trial(ll_tok, text, grammar)
            reply = {"ok": text}
        except QuickdraftError as e:
            reply = {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - a library failure on odd input is still the input's
            reply = {"error": f"the constraint could not be compiled: {type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
