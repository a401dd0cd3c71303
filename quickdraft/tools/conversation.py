"""A conversation as a client holds one (`quickdraft bench --conversation`): a long system prompt, then turns, every
request carrying the whole history: what a chat page or an agent sends. What users feel there is the time to the
first token of each turn (a prefill of everything the server does not already hold) and the whole turn's time;
decode tok/s is the smaller part. The same script runs against local configurations (one LLM, its engine with or
without prefix reuse, with or without its draft) and remote servers (llama-server, vLLM, SGLang, quickdraft serve),
one after the other, each conversation alone on the machine.

Two scripts: `chat` (a reference text as the system prompt, then questions about it) and `agent` (the same text with
tool definitions in the system prompt, and a tool result of a few hundred tokens before each question, as an agent's
loop resends them). Answers are greedy and of a fixed length (ignore_eos), so every configuration decodes the same
number of tokens; each answer joins the history as the text the configuration wrote.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

from quickdraft.errors import QuickdraftError
from quickdraft.tools.prompts import reference_text

QUESTIONS = [
    "Summarise the text above in two sentences.",
    "Which older techniques did the press combine? List them.",
    "How did printing change the work of scholars?",
    "What happened to the price of books, and why?",
    "Name one consequence of printing for religion described in the text.",
    "Write a one-line title for the text.",
    "Which claim in the text would you check first, and how?",
    "Explain the text to a ten-year-old in three sentences.",
]
TOOLS = [{"type": "function", "function": {"name": "search_archive", "description": "Search a library archive.",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}, "year_from": {"type": "integer"},
                                               "year_to": {"type": "integer"}}, "required": ["query"]}}},
         {"type": "function", "function": {"name": "get_record", "description": "Fetch one catalogue record.",
                                           "parameters": {"type": "object", "properties": {
                                               "record_id": {"type": "string"}}, "required": ["record_id"]}}}]


def script(kind: str = "chat", turns: int = 6) -> tuple[list[dict], list[list[dict]]]:
    """(the opening messages, each turn's new messages) of a conversation."""
    if kind not in ("chat", "agent"):
        raise QuickdraftError(f"--conversation {kind!r}: choose chat or agent")
    if not 1 <= turns <= len(QUESTIONS):
        raise QuickdraftError(f"--turns must be between 1 and {len(QUESTIONS)}")
    system = "You are a careful assistant. Answer from the reference text below.\n\n" + reference_text()
    if kind == "agent":
        system += "\n\nTools you may call:\n" + json.dumps(TOOLS, indent=1)
    steps = []
    for i, question in enumerate(QUESTIONS[:turns]):
        if kind == "agent":  # a tool's result (records of the archive) arrives before each question
            records = [{"record_id": f"r{i}-{j}", "title": f"Printed book {j} of batch {i}",
                        "year": 1455 + 7 * i + j, "pages": 120 + 13 * j, "place": ["Mainz", "Venice", "Paris"][j % 3]}
                       for j in range(6)]
            steps.append([{"role": "user", "content": "Results of search_archive:\n" + json.dumps(records)
                           + "\n\n" + question}])
        else:
            steps.append([{"role": "user", "content": question}])
    return [{"role": "system", "content": system}], steps


@dataclass
class Turn:
    ttft_s: float  # request sent -> first token
    seconds: float  # the whole turn
    tokens: int
    decode_tok_s: float  # tokens after the first over the time from the first to the last
    prompt_tokens: int | None = None
    cache_n: int | None = None  # prompt tokens the engine took from its cache, where it says


@dataclass
class Run:
    name: str
    turns: list[Turn] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return sum(t.seconds for t in self.turns)


def converse(name: str, reply, kind: str, turns: int, max_tokens: int) -> Run:
    """One conversation: reply(messages, max_tokens) -> (text, Turn) answers each turn over the whole history."""
    messages, steps = script(kind, turns)
    run = Run(name)
    for step in steps:
        messages = messages + step
        text, turn = reply(messages, max_tokens)
        run.turns.append(turn)
        messages = messages + [{"role": "assistant", "content": text}]
    return run


def local_reply(llm, reuse: bool = True, speculation=None):
    """Answers from a loaded LLM's engine, timed as a streaming client would: reuse False prefills every prompt."""
    from quickdraft.config import SamplingParams

    def reply(messages, max_tokens):
        prompt = llm.chat_prompt(messages)
        params = SamplingParams(max_tokens=max_tokens, stop_at_eos=False)
        start = time.perf_counter()
        stamps, pieces = [], []
        for event in llm.engine.generate(prompt, params, speculation, reuse=reuse):
            if event.token is not None:
                stamps.append(time.perf_counter())
            pieces.append(event.text)
            timings = event.timings
        end = time.perf_counter()
        n = len(stamps)
        decode = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and stamps[-1] > stamps[0] else 0.0
        return "".join(pieces), Turn(stamps[0] - start if stamps else end - start, end - start, n, decode,
                                     len(prompt), timings.cache_n)

    return reply


def remote_reply(endpoint):
    """Answers from an OpenAI-compatible server (remote.Endpoint), streamed."""

    def reply(messages, max_tokens):
        r = endpoint.complete(messages, max_tokens)
        return r.text, Turn(r.ttft_s, r.seconds, r.n, r.decode_tok_s, None, r.cache_n)

    return reply


def table(runs: list[Run], kind: str, max_tokens: int) -> str:
    n = max(len(r.turns) for r in runs)
    lines = [f"conversation ({kind}): {n} turns, each request the whole history, {max_tokens} greedy tokens a turn; "
             "time to first token per turn, the whole conversation's time, median decode tok/s"]
    head = f"{'configuration':34}" + "".join(f"{'turn ' + str(i + 1):>9}" for i in range(n))
    lines.append(head + f"{'total':>9}{'decode':>8}")
    for r in runs:
        ttft = "".join(f"{t.ttft_s:8.2f}s" for t in r.turns)
        decode = statistics.median(t.decode_tok_s for t in r.turns)
        lines.append(f"{r.name[:34]:34}{ttft}{r.total_s:8.1f}s{decode:8.1f}")
    cached = [r for r in runs if any(t.cache_n for t in r.turns)]
    for r in cached:
        lines.append(f"  {r.name}: prompt tokens taken from the cache per turn: "
                     + ", ".join(str(t.cache_n) for t in r.turns))
    return "\n".join(lines)


def to_dict(runs: list[Run], kind: str, max_tokens: int) -> dict:
    return {"kind": kind, "max_tokens": max_tokens,
            "runs": [{"name": r.name, "total_s": r.total_s, "turns": [asdict(t) for t in r.turns]} for r in runs]}
