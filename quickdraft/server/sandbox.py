"""Constraints from requests are compiled in a child process first, so that none can take the server down.

llguidance is a native library: a grammar that overflows its stack kills the process that compiles it (a
segfault: nothing to catch), and its GBNF reader is pure Python, quadratic in the rules, holding the GIL. Bounds
(grammar.check_bounds) refuse what is far beyond any real constraint; this sandbox is what stands when a bound is
not enough. One child process (`python -m quickdraft.server.sandbox`, no PyTorch: llguidance and the tokenizer
only) compiles each constraint and walks its matcher through its first tokens (grammar.trial), one request at a
time. The server then builds its own matcher from the compiled text the child sends back, which takes
milliseconds. A child that crashes, runs past the timeout, or is still compiling for a client that has gone away
is killed, and a new one is started for the next request. Its memory is capped (RLIMIT_AS), so a runaway compile
fails there too.

Why a process and not a thread: a thread shares the server's stack space and GIL, and nothing can stop a thread
running native code. Why one long-lived child: building llguidance's view of a large vocabulary takes about as
long as a compile can, so each child builds it once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile

from quickdraft import grammar as grammars
from quickdraft.errors import QuickdraftError
from quickdraft.grammar import Grammar

TIMEOUT_S = 10.0  # a constraint compiles in milliseconds; this is for the ones that never would
MEMORY_BYTES = 4 << 30  # the child's address space
READY_TIMEOUT_S = 120.0  # building the vocabulary's view, once per child


class GrammarSandbox:
    """Compiles request constraints in a child process (see the module's note); `compile` is a coroutine."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], timeout_s: float = TIMEOUT_S,
                 bounds: bool = True):
        """bounds False lets constraints beyond grammar.check_bounds reach the child (tests of the isolation)."""
        self.tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, sorted(eos_ids)
        self.timeout_s, self.bounds = timeout_s, bounds
        self.proc: asyncio.subprocess.Process | None = None
        self.lock: asyncio.Lock | None = None  # made on the event loop that uses it
        self.restarts = 0

    async def compile(self, grammar: Grammar) -> str:
        """The constraint as llguidance text, checked by the child: QuickdraftError (the client's fault) if it is
        out of bounds, invalid, crashes the compiler or takes longer than the timeout."""
        if self.bounds:
            grammars.check_bounds(grammar)  # cheap, and spares the child the obvious cases
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            proc = await self._ready()
            try:
                return await self._ask(proc, grammar)
            except asyncio.CancelledError:  # the client went away: the child may still be compiling for it
                await self._kill()
                raise

    async def _ask(self, proc, grammar: Grammar) -> str:
        proc.stdin.write(json.dumps({"kind": grammar.kind, "text": grammar.text}).encode() + b"\n")
        await proc.stdin.drain()
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), self.timeout_s)
        except asyncio.TimeoutError:
            await self._kill()
            raise QuickdraftError(f"the {grammar.describe()} did not compile within {self.timeout_s:g} s: "
                                  "simplify it") from None
        if not line:  # the child died compiling it
            self.proc = None
            code = await proc.wait()
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            raise QuickdraftError(f"the {grammar.describe()} crashed the grammar compiler (llguidance, {how}): "
                                  "simplify it (fewer rules, less nesting)")
        reply = json.loads(line)
        if "error" in reply:
            raise QuickdraftError(reply["error"])
        return reply["ok"]

    async def _ready(self):
        if self.proc is not None and self.proc.returncode is None:
            return self.proc
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
            f.write(self.tokenizer_json)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "quickdraft.server.sandbox", f.name, str(self.vocab_size),
                json.dumps(self.eos_ids), str(MEMORY_BYTES), str(int(self.bounds)), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, limit=64 << 20)
            line = await asyncio.wait_for(self.proc.stdout.readline(), READY_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            await self._kill()
            raise QuickdraftError(f"structured output is not available: the grammar compiler did not start ({e})")
        finally:
            os.unlink(f.name)
        reply = json.loads(line or b'{"error": "the grammar compiler exited at start"}')
        if "error" in reply:
            await self._kill()
            raise QuickdraftError(reply["error"])
        self.restarts += 1
        return self.proc

    async def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def start(self) -> None:
        """Start the child now (the first constrained request would otherwise wait for it)."""
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            await self._ready()

    async def close(self) -> None:
        await self._kill()


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
