"""What stops one request or one file from taking quickdraft down, piece by piece: constraint bounds and the compile
sandbox, stop strings in linear time, streamed text with a real U+FFFD, crafted GGUF files, killed pulls.
(tests/test_server_attacks.py runs the same attacks against a real server.)"""

import asyncio
import json
import os
import random
import signal
import string
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
from hypothesis import given, settings, strategies as st

from quickdraft import grammar as grammars
from quickdraft.errors import QuickdraftError
from quickdraft.grammar import Grammar
from quickdraft.server import protocol as p
from quickdraft.server import sandbox as sandbox_module
from quickdraft.server.sandbox import GrammarSandbox
from quickdraft.server.stops import StopMatcher
from tests.helpers import (assert_one_line_error, cli, gbnf_chain, lark_chain, ref_chain, tiny_hf_model,
                           write_gguf_from_hf)


# ---- constraint bounds and the sandbox ------------------------------------------------------------------------

@pytest.mark.parametrize("grammar, fragment", [
    (Grammar("grammar", lark_chain(3000)), "defines 3002 rules"),  # these crash llguidance (segfault)
    (Grammar("grammar", gbnf_chain(6000)), "bytes"),
    (Grammar.json_schema(ref_chain(4000)), "bytes"),
    (Grammar.json_schema(ref_chain(600)), "601 \\$ref"),
    (Grammar("grammar", "root ::= " + "(" * 100 + '"a"' + ")" * 100), "nests brackets 100 deep"),
    (Grammar("regex", "(" * 70 + "a" + ")" * 70), "nests brackets 70 deep"),
    (Grammar.json_schema({"type": "array", "items": json.loads('{"items": ' * 70 + "{}" + "}" * 70)}), "nests"),
])
def test_constraints_beyond_the_bounds_are_refused_before_compiling(grammar, fragment):
    with pytest.raises(QuickdraftError, match=fragment):
        grammars.check_bounds(grammar)


def test_constraints_within_the_bounds_pass_them():
    for grammar in (Grammar("grammar", lark_chain(900)), Grammar.json_schema(ref_chain(400)),
                    Grammar("regex", "[a-z]{2,8}@(x|y)\\.org"), Grammar("json_object")):
        grammars.check_bounds(grammar)


@pytest.fixture(scope="module")
def vocabulary():
    """A small byte-level vocabulary as tokenizer.json text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    from tests.helpers import byte_level_vocab

    tokens = byte_level_vocab(300)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def test_the_sandbox_survives_what_kills_a_compiler(vocabulary):
    """Without the bounds, a 3000-rule chain segfaults llguidance: in the sandbox that is an error for the
    request, and the next constraint compiles in a new child. A compile past the timeout is killed the same way;
    one whose client goes away (the task is cancelled) compiles on, and its outcome is kept for the next client."""
    async def scenario():
        sandbox = GrammarSandbox(vocabulary, 300, [299], timeout_s=1.0, bounds=False, lanes=1)
        try:
            assert "regex" in await sandbox.compile(Grammar("regex", "[ab]{2}"))
            with pytest.raises(QuickdraftError, match="crashed the grammar compiler .*signal"):
                await sandbox.compile(Grammar("grammar", lark_chain(3000)))
            assert await sandbox.compile(Grammar("regex", "c+"))
            with pytest.raises(QuickdraftError, match="did not compile within 1 s"):
                await sandbox.compile(Grammar("grammar", gbnf_chain(3000)))  # its GBNF reader is quadratic
            leaving = Grammar("grammar", gbnf_chain(3001))  # not the one kept
            slow = asyncio.create_task(sandbox.compile(leaving))
            await asyncio.sleep(0.3)
            restarts = sandbox.restarts  # a child is compiling for it
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            assert list(sandbox.compiling) == [("grammar", leaving.text)]  # it compiles on, for nobody
            await asyncio.gather(*sandbox.compiling.values())  # to its time limit: that child is killed
            with pytest.raises(QuickdraftError, match="did not compile within 1 s"):
                await sandbox.compile(leaving)  # its outcome was kept: no child is started for it again
            assert await sandbox.compile(Grammar("regex", "d+")) and sandbox.restarts == restarts + 1
            sandbox.timeout_s = 10.0  # this one takes 0.8-1.1 s to fail on a 2-core machine: not a timeout test
            with pytest.raises(QuickdraftError, match="invalid regular expression: lexer error") as e:
                await sandbox.compile(Grammar("regex", "a{1000}{1000}"))  # compiles, then fails at its first token
            assert "<" not in str(e.value)  # none of llguidance's internal state
        finally:
            await sandbox.close()

    asyncio.run(scenario())


def test_gbnf_rules_count_whatever_line_break_separates_them():
    """llguidance's GBNF reader takes a carriage return (and other breaks) between rules: the bound counts them."""
    for sep in ("\r", "\r\n", "\n"):
        with pytest.raises(QuickdraftError, match="defines 1502 rules"):
            grammars.check_bounds(Grammar("grammar", gbnf_chain(1500).replace("\n", sep)))


def test_a_valid_constraint_does_not_wait_behind_grammar_bombs(vocabulary):
    """Both shared lanes busy with bombs' first tries and two more bombs waiting, then a valid constraint: it gets
    the next lane before the waiting bombs (shortest first), and is answered while every bomb still compiles and
    before the waiting ones had their first tries."""
    async def scenario():
        sandbox = GrammarSandbox(vocabulary, 300, [299], timeout_s=60.0, bounds=False, first_try_s=1.0)
        try:
            await sandbox.start()
            for lane in sandbox.lanes:  # the bombs' first tries run to their end, however fast the machine
                os.kill(lane.proc.pid, signal.SIGSTOP)
            bombs = [asyncio.create_task(sandbox.compile(Grammar("grammar", gbnf_chain(5000 + i)))) for i in range(4)]
            while len(sandbox.turns.waiting) < 2:
                await asyncio.sleep(0.01)
            start = time.perf_counter()
            assert "regex" in await sandbox.compile(Grammar("regex", "[ab]{2}"))
            valid_s = time.perf_counter() - start
            print(f"\nvalid regex behind 2 first tries and 2 waiting bombs: {valid_s:.2f} s (a first try: 1 s)")
            assert not any(b.done() for b in bombs), "the valid constraint waited for a bomb"
            assert sandbox.on_slow == 2, "the valid constraint waited for the waiting bombs' first tries"
        finally:
            await sandbox.close()

    asyncio.run(scenario())


@pytest.fixture
def a_child_that_never_gets_ready(tmp_path, monkeypatch):
    """Lanes start children that never say they are ready (a stand-in for sys.executable that sleeps)."""
    sleeper = tmp_path / "sleeper"
    sleeper.write_text("#!/bin/sh\nexec sleep 60\n")
    sleeper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(sleeper))


def test_a_compiler_that_does_not_start_is_the_servers_fault(vocabulary, tmp_path, monkeypatch):
    """A child that exits at start (no memory, say) is a 503 the client may retry, not a 400 blaming its
    constraint, on a shared lane or the slow one; and nothing is kept, so the next request tries again."""
    from quickdraft.server.requests import constraint
    from quickdraft.server.sandbox import CompilerUnavailable

    quitter = tmp_path / "quitter"
    quitter.write_text("#!/bin/sh\nexit 3\n")
    quitter.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(quitter))

    async def scenario():
        sandbox = GrammarSandbox(vocabulary, 300, [299], lanes=1)
        with pytest.raises(CompilerUnavailable, match="exited at start"):
            await sandbox.compile(Grammar("regex", "[ab]{2}"))
        assert not sandbox.kept and not sandbox.refused
        state = SimpleNamespace(sandbox=sandbox)
        req = SimpleNamespace(requested_grammar=lambda: Grammar("regex", "[ab]{2}"))
        with pytest.raises(p.APIError) as refused:
            await constraint(state, req)
        await sandbox.close()
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.status == 503 and refused.headers["Retry-After"]


@pytest.mark.parametrize("who", ["shutdown", "close", "client"])
def test_a_child_whose_start_is_cancelled_is_not_left_behind(vocabulary, a_child_that_never_gets_ready, who):
    """A lane's child cancelled while it starts (the server's shutdown cancels the lanes' start; close() cancels the
    compiles; a client leaves while its compile waits for a child) is killed, not left alive with a vocabulary
    nobody will use."""
    me = psutil.Process()

    async def scenario():
        before = len(me.children())
        sandbox = GrammarSandbox(vocabulary, 300, [299], lanes=1)
        work = asyncio.create_task(sandbox.start() if who == "shutdown" else
                                   sandbox.compile(Grammar("regex", "[ab]{2}")))
        while len(me.children()) == before:  # the child runs, and never says it is ready
            await asyncio.sleep(0.01)
        if who != "close":
            work.cancel()
        await asyncio.sleep(0.1)
        await sandbox.close()
        await asyncio.gather(work, return_exceptions=True)
        return before, len(me.children())

    before, after = asyncio.run(scenario())
    print(f"\nchildren before {before}, after a start cancelled by {who}: {after}")
    assert after == before


def test_a_time_out_is_kept_for_a_while_only_and_refusals_never_evict_what_compiled(vocabulary):
    """A time-out (or a crash) may be the machine's load, not the constraint: it is refused again from the cache only
    for RETRY_S, then compiled anew. Constraints refused, however many, never push out those that compiled."""
    async def scenario():
        sandbox = GrammarSandbox(vocabulary, 300, [299], timeout_s=0.3, first_try_s=0.3, lanes=1)
        try:
            await sandbox.start()
            assert await sandbox.compile(Grammar("regex", "a+"))
            os.kill(sandbox.lanes[0].proc.pid, signal.SIGSTOP)  # a compile that cannot finish in time
            with pytest.raises(QuickdraftError, match="did not compile within 0.3 s"):
                await sandbox.compile(Grammar("regex", "[ab]{2}"))
            restarts = sandbox.restarts
            with pytest.raises(QuickdraftError, match="did not compile within 0.3 s"):
                await sandbox.compile(Grammar("regex", "[ab]{2}"))  # from the cache: no child was asked
            assert sandbox.restarts == restarts
            now = time.monotonic()
            sandbox.clock = lambda: now + sandbox_module.RETRY_S
            sandbox.timeout_s = sandbox.first_try_s = 30.0
            assert await sandbox.compile(Grammar("regex", "[ab]{2}"))  # compiled anew
            for i in range(sandbox_module.CACHE_SIZE + 1):
                with pytest.raises(QuickdraftError):
                    await sandbox.compile(Grammar("regex", f"({i}"))
            assert ("regex", "a+") in sandbox.kept and len(sandbox.refused) == sandbox_module.CACHE_SIZE
        finally:
            await sandbox.close()

    asyncio.run(scenario())


def test_lanes_go_to_the_shortest_constraint_waiting_and_a_full_queue_refuses_the_longest():
    """Compiles waiting for a first try get the shared lane shortest first, never behind longer bombs; with the
    waiting places all taken, a shorter constraint displaces the longest, and a longer one is refused."""
    from quickdraft.server.sandbox import CompilerBusy, _Turns

    async def scenario():
        turns = _Turns(["lane"], limit=2)
        assert turns.ask(100).result() == "lane"  # free: at once
        bomb, valid = turns.ask(60_000), turns.ask(20)
        shorter = turns.ask(30)  # full: the bomb gives its place up
        with pytest.raises(CompilerBusy):
            await bomb
        with pytest.raises(CompilerBusy):
            turns.ask(40_000)  # full, and none waiting is longer
        turns.give("lane")
        assert valid.result() == "lane" and not shorter.done()
        turns.give("lane")
        assert shorter.result() == "lane"
        turns.give("lane")
        assert turns.free == ["lane"]

    asyncio.run(scenario())


def test_the_slow_lane_has_its_own_budget_and_first_tries_go_on(vocabulary):
    """What needs more than a first try waits for the slow lane within its own budget; one more is refused (a
    503, not kept) instead of holding a place, and a valid constraint still gets its first try."""
    from quickdraft.server.sandbox import CompilerBusy

    async def scenario():
        sandbox = GrammarSandbox(vocabulary, 300, [299], timeout_s=60.0, first_try_s=0.2, bounds=False, lanes=1,
                                 max_slow=1)
        try:
            await sandbox.start()
            await sandbox.slow.ready()
            os.kill(sandbox.slow.proc.pid, signal.SIGSTOP)  # the slow lane's compile cannot end
            on_slow = asyncio.create_task(sandbox.compile(Grammar("grammar", gbnf_chain(3000))))
            while not sandbox.on_slow:  # its first try ran out: it waits on the slow lane now
                await asyncio.sleep(0.05)
            with pytest.raises(CompilerBusy, match="need more than 0.2 s"):
                await sandbox.compile(Grammar("grammar", gbnf_chain(3001)))  # needs the slow lane too: refused
            assert ("grammar", gbnf_chain(3001)) not in sandbox.refused
            assert "regex" in await sandbox.compile(Grammar("regex", "[ab]{2}"))
            assert not on_slow.done()
        finally:
            await sandbox.close()

    asyncio.run(scenario())


def test_a_full_queue_refuses_a_constrained_request_before_compiling_it():
    """With every place in the queue taken, a constrained request is a 503 at once: its constraint is not compiled
    first, for nothing."""
    from types import SimpleNamespace

    from quickdraft.server.bodies import parse_body
    from quickdraft.server.metrics import Metrics
    from quickdraft.server.responses import respond
    from quickdraft.server.worker import EngineWorker

    compiled = []

    class Sandbox:
        async def compile(self, grammar):
            compiled.append(grammar)
            return "compiled"

    class Request:  # a client that stays
        async def receive(self):
            await asyncio.Event().wait()

    engine = SimpleNamespace(context=64, speculation=None, drafter=None, target=SimpleNamespace(chunk=64), max_rows=64,
                             slots=SimpleNamespace(count=1, free=lambda: 1),
                             grammars=SimpleNamespace(constraint=lambda grammar, text: None))
    worker = EngineWorker(lambda: SimpleNamespace(engine=engine), 0, Metrics())  # every place taken: none
    state = SimpleNamespace(engine=engine, worker=worker, sandbox=Sandbox())
    req = parse_body(b'{"prompt": "x", "max_tokens": 2, "regex": "[ab]{2}"}', p.CompletionRequest)
    try:
        with pytest.raises(p.APIError) as refused:
            asyncio.run(respond(state, Request(), req, [1, 2], chat=False, max_tokens=2))
    finally:
        worker.stop()
    assert refused.value.status == 503 and compiled == []


_pieces = st.sampled_from(["a", "b", "(a|b)", "[a-c]", "x?", "y*", "z+", "(ab){2}", "\\.", "[0-9]{1,3}", ".", "("])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(parts=st.lists(_pieces, min_size=1, max_size=12))
def test_random_regexes_compile_or_are_refused_with_a_message(parts):
    regex = "".join(parts)
    try:
        text = grammars.to_llguidance(Grammar("regex", regex))
    except QuickdraftError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert text


# ---- stop strings ---------------------------------------------------------------------------------------------

def naive(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """The reference: the text up to the first stop string to be complete, as if streamed one character at a time."""
    text = "".join(pieces)
    for end in range(1, len(text) + 1):
        for s in stops:
            if text[:end].endswith(s):
                return text[:end - len(s)], True
    return text, False


@settings(max_examples=300, deadline=None, derandomize=True)
@given(stops=st.lists(st.text("ab-X", min_size=1, max_size=6), min_size=1, max_size=4),
       pieces=st.lists(st.text("ab-X", max_size=5), max_size=12))
def test_stop_matching_equals_the_naive_search(stops, pieces):
    m = StopMatcher(stops)
    shown = "".join(m.push(p) for p in pieces)
    assert (shown + m.flush(), m.matched) == naive(stops, pieces)


def test_a_long_near_match_is_held_and_released_in_linear_steps():
    stops = ["-" * 511 + "X"] * 16
    m = StopMatcher(stops)
    out = "".join(m.push("---") for _ in range(2000))
    assert len(m.held) == 511 and len(out) == 6000 - 511 and not m.matched
    assert m.flush() == "-" * 511


# ---- streamed text --------------------------------------------------------------------------------------------

def test_a_real_replacement_character_is_streamed_at_once(vocabulary):
    from tokenizers import Tokenizer as Backend

    from quickdraft.engine import Detokenizer
    from quickdraft.tokenizer import Tokenizer

    tok = Tokenizer(Backend.from_str(vocabulary))
    for text in ["x \ufffd y", "end \ufffd", "\ufffd\ufffd more", "中文 😀 e\u0301"]:
        ids = tok.encode(text)
        d = Detokenizer(tok)
        pieces = [d.push(i) for i in ids]
        assert "".join(pieces) + d.flush() == text
        real = [i for i, p in enumerate(pieces) if "\ufffd" in p]
        assert all(pieces[i] for i in real)  # never held back
        assert "\ufffd" not in "".join(p for p in pieces if "\ufffd" not in text)  # a split character is held
    d = Detokenizer(tok)
    assert [d.push(i) for i in tok.encode("😀")][:-1] == ["", "", ""]  # four bytes, four tokens: held till whole


# ---- crafted GGUF files ---------------------------------------------------------------------------------------

def _gguf_bytes(kv: bytes, n_kv: int = 1, n_tensors: int = 0) -> bytes:
    return b"GGUF" + (3).to_bytes(4, "little") + n_tensors.to_bytes(8, "little") + n_kv.to_bytes(8, "little") + kv


def _key(name: str) -> bytes:
    return len(name).to_bytes(8, "little") + name.encode()


@pytest.mark.parametrize("body, fragment", [
    (_gguf_bytes(_key("x") + (9).to_bytes(4, "little") + (0).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little")
                 + bytes(16)), "1099511627776 items"),
    (_gguf_bytes(_key("tokens") + (9).to_bytes(4, "little") + (8).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little")
                 + bytes(16)), "claims 1099511627776 items"),
    (_gguf_bytes(b"", n_kv=1 << 50), "claims 0 tensors and 1125899906842624 metadata keys"),
    (_gguf_bytes(_key("k") + (8).to_bytes(4, "little") + (1 << 60).to_bytes(8, "little")), "runs past the end"),
])
def test_crafted_counts_are_refused_before_parsing(tmp_path, body, fragment):
    path = tmp_path / "crafted.gguf"
    path.write_bytes(body)
    assert_one_line_error(cli("generate", "-m", str(path), "-p", "x"), "not a readable GGUF file", fragment)


@pytest.mark.parametrize("metadata, fragment", [
    ({"block_count": 10**6}, "block_count = 1000000, but the file holds tensors for 2 layers"),
    ({"head_count": 0}, "head_count = 0"),
    ({"embedding_length": 2**31}, "embedding_length = 2147483648, but token_embd.weight has shape"),
])
def test_metadata_that_contradicts_the_tensors_is_one_line(tmp_path, metadata, fragment):
    path = write_gguf_from_hf(tiny_hf_model("llama"), tmp_path / "m.gguf", metadata=metadata)
    assert_one_line_error(cli("generate", "-m", str(path), "-p", "x"), fragment)


def test_a_schema_that_would_crash_llguidance_is_one_line_on_the_command_line(tmp_path):
    path = write_gguf_from_hf(tiny_hf_model("llama"), tmp_path / "m.gguf", eos=True)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(ref_chain(2000)))
    assert_one_line_error(cli("generate", "-m", str(path), "-p", "x", "--json-schema", str(schema)), "2001 $ref")


# ---- pulls ----------------------------------------------------------------------------------------------------

def test_a_pull_removes_what_a_killed_pull_left(tmp_path, monkeypatch):
    from quickdraft.weights import hub

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    path = hub.model_path("smollm2-135m")
    path.parent.mkdir(parents=True)
    left = path.parent / f".pull-{path.name}-x1y2"  # a killed pull's temporary directory and partial file
    left.mkdir()
    (left / path.name).write_bytes(b"\0" * 1000)
    other = path.parent / ".pull-another-model.gguf-z"  # another model's pull: not this one's to remove
    other.mkdir()
    calls = []
    monkeypatch.setattr(hub, "_assemble", lambda alias, model, p, progress: calls.append(alias) or p)
    assert hub.pull("smollm2-135m") == path and calls == ["smollm2-135m"]
    assert not left.exists() and other.exists()


def test_random_names_never_reach_the_json_walk_as_non_strings():
    from quickdraft.server import bodies

    body = {"prompt": "x", "".join(random.Random(0).choices(string.ascii_letters, k=9)): {"a": ["\ud800"]}}
    with pytest.raises(p.APIError, match="unpaired UTF-16 surrogate") as e:
        bodies._check_values(body)
    assert e.value.param.endswith(".a.0")


def test_work_for_a_client_that_left_is_cancelled():
    from quickdraft.server.requests import ClientGone, unless_disconnected

    class Leaving:  # a request whose client goes away while its constraint compiles
        async def receive(self):
            await asyncio.sleep(0.1)
            return {"type": "http.disconnect"}

    cancelled = []

    async def compile_forever():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario():
        with pytest.raises(ClientGone):
            await unless_disconnected(Leaving(), compile_forever())
        assert await unless_disconnected(Leaving(), asyncio.sleep(0, result=7)) == 7

    asyncio.run(scenario())
    assert cancelled == [True]
