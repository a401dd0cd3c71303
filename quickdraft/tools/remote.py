"""bench and verify against any OpenAI-compatible server: quickdraft serve, llama-server, vLLM, SGLang.

Users who outgrow one machine move to a serving engine; this measures what speculation gives there, with the
same prompts and method as the local bench (warm-up, interleaved runs, medians with min-max), and proves (or
disproves) that a speculative deployment answers as a plain one does. Only HTTP: nothing of the engine is loaded.

Decode tok/s is read from the streamed chunks' arrival: the tokens after the first over the time from the first
chunk to the last, apart from end-to-end tok/s (all tokens over the whole request) and TTFT. The server's own
speculation figures are read where it reports them: a `timings` object on the last chunk (llama-server's and
quickdraft's `draft_n` / `draft_n_accepted`), or Prometheus counters ending in `spec_decode_num_draft_tokens_total`
and `spec_decode_num_accepted_tokens_total` (vLLM's `vllm:` ones, quickdraft's) at --metrics-url.
"""

from __future__ import annotations

import functools
import json
import ssl
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from quickdraft.errors import QuickdraftError

SEED = 1234  # the seeded comparison's seed (any fixed one)


@functools.cache
def tls() -> ssl.SSLContext:
    """httpx's default TLS context (certificates verified, SSL_CERT_FILE honoured), built once. Given no context,
    each httpx.get / post / stream builds its own, parsing the CA bundle: 25-40 ms of CPU on a 2-core EPYC, which a
    request timed from its start counted into its time to first token, and which a test suite of hundreds of requests
    paid again and again."""
    return httpx.create_ssl_context()


@dataclass
class Reply:
    text: str
    n: int  # completion tokens (the usage's, else the chunks counted)
    ttft_s: float
    decode_tok_s: float  # tokens after the first / time from the first chunk to the last
    e2e_tok_s: float
    tokens: list[str] | None = None  # the tokens' texts, where the server gives logprobs
    drafted: int | None = None  # the server's timings, where it reports them
    accepted: int | None = None
    finish: str | None = None
    cache_n: int | None = None  # prompt tokens the server took from its cache (llama-server's and quickdraft's timings)
    seconds: float = 0.0  # the whole request


@dataclass
class Endpoint:
    """One server: its base URL (with or without /v1), key, model name (default: the first it lists) and where its
    Prometheus metrics are, if anywhere."""

    url: str
    api_key: str | None = None
    model: str | None = None
    metrics_url: str | None = None
    timeout: float = 600.0
    sends_ignore_eos: bool = True  # turned off when the server refuses the field
    sends_logprobs: bool = True
    sends_cache_prompt: bool = True
    extra: dict | None = None  # fields added to every request's body (e.g. quickdraft's {"speculative": ...})

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def check(self) -> str:
        """The model it serves (a one-line QuickdraftError when it cannot be reached or does not speak the API)."""
        try:
            r = httpx.get(self.base + "/models", headers=self._headers(), timeout=30, verify=tls())
        except httpx.HTTPError as e:
            raise QuickdraftError(f"cannot reach {self.url}: {type(e).__name__}: {e}; is the server running "
                                  "there (and is the URL its address, e.g. http://127.0.0.1:8080)?") from None
        if r.status_code == 401:
            raise QuickdraftError(f"{self.url} refused the request (401): give its key with --api-key")
        try:
            models = [m["id"] for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise QuickdraftError(f"{self.url} does not answer as an OpenAI-compatible server: GET {self.base}/models "
                                  f"gave HTTP {r.status_code} {r.text[:80]!r}") from None
        if not models:
            raise QuickdraftError(f"{self.url} lists no model at GET {self.base}/models")
        if self.model is None:
            self.model = models[0]
        return self.model

    def complete(self, prompt: str | list[dict], max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 fixed_length: bool = True, logprobs: bool = False, fresh: bool = False) -> Reply:
        """One streamed chat completion of the prompt as a user message (or of chat messages: a conversation's
        history), timed chunk by chunk; with logprobs, the tokens' texts too (for verify: bench leaves them out,
        they cost the server time). fresh: ask the server to prefill the whole prompt (llama-server's cache_prompt
        false: its greedy output depends on whether the prompt was cached, a near tie flipping with the batch
        shape)."""
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
        if seed is not None:
            body["seed"] = seed
        body.update(self.extra or {})
        if fixed_length and self.sends_ignore_eos:
            body["ignore_eos"] = True  # llama-server's, vLLM's and quickdraft's: every run decodes max_tokens
        if logprobs and self.sends_logprobs:
            body["logprobs"] = True
        if fresh and self.sends_cache_prompt:
            body["cache_prompt"] = False
        for _ in range(4):
            try:
                return self._stream(body)
            except _Refused as e:  # a server without the extension: drop it and say nothing more
                if "ignore_eos" in body and "ignore_eos" in e.message:
                    self.sends_ignore_eos = False
                    body.pop("ignore_eos")
                elif "logprobs" in body and "logprobs" in e.message:
                    self.sends_logprobs = False
                    body.pop("logprobs")
                elif "cache_prompt" in body and "cache_prompt" in e.message:
                    self.sends_cache_prompt = False
                    body.pop("cache_prompt")
                else:
                    raise QuickdraftError(f"{self.url} refused the request: {e.message}") from None
        raise QuickdraftError(f"{self.url} refused the request")

    def _stream(self, body: dict) -> Reply:
        start = time.perf_counter()
        text, tokens, stamps, usage, timings, finish = [], [], [], None, None, None
        every_piece_scored = "logprobs" in body  # llama-server gives no logprobs for drafted tokens: text then
        try:
            with httpx.stream("POST", self.base + "/chat/completions", json=body, headers=self._headers(),
                              timeout=self.timeout, verify=tls()) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _Refused(r.status_code, _message(r))
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise QuickdraftError(f"{self.url}: {chunk['error'].get('message', chunk['error'])}")
                    usage = chunk.get("usage") or usage
                    timings = chunk.get("timings") or timings
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") or ""
                        scored = ((choice.get("logprobs") or {}).get("content")) or []
                        if piece or scored:
                            stamps.append(time.perf_counter())
                            text.append(piece)
                            tokens += [t.get("token", "") for t in scored]
                            every_piece_scored &= bool(scored) or not piece
                        finish = choice.get("finish_reason") or finish
        except httpx.HTTPError as e:
            raise QuickdraftError(f"{self.url}: the request failed: {type(e).__name__}: {e}") from None
        end = time.perf_counter()
        n = (usage or {}).get("completion_tokens") or len(tokens) or len(stamps)
        decode = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and len(stamps) > 1 and stamps[-1] > stamps[0] else 0.0
        return Reply("".join(text), n, (stamps[0] if stamps else end) - start, decode, n / (end - start),
                     tokens if every_piece_scored and tokens else None,
                     (timings or {}).get("draft_n"), (timings or {}).get("draft_n_accepted"), finish,
                     (timings or {}).get("cache_n"), end - start)

    def spec_counters(self) -> tuple[float, float] | None:
        """(drafted, accepted) from the Prometheus counters at metrics_url, summed over labels; None without."""
        if not self.metrics_url:
            return None
        from prometheus_client.parser import text_string_to_metric_families

        try:
            r = httpx.get(self.metrics_url, headers=self._headers(), timeout=30, verify=tls())
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise QuickdraftError(f"cannot read metrics at {self.metrics_url}: {e}") from None
        drafted = accepted = 0.0
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name.endswith("spec_decode_num_draft_tokens_total"):
                    drafted += sample.value
                elif sample.name.endswith("spec_decode_num_accepted_tokens_total"):
                    accepted += sample.value
        return drafted, accepted


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _message(r: httpx.Response) -> str:
    try:
        error = r.json().get("error")
        return f"HTTP {r.status_code}: " + (error.get("message") if isinstance(error, dict) else str(error))
    except (ValueError, AttributeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"


# ---- bench --------------------------------------------------------------------------------------------------

@dataclass
class Cell:
    """One endpoint on one prompt: every measured request (of every stream, under concurrency)."""
    decode: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    aggregate: list[float] = field(default_factory=list)  # per run: all streams' tokens over the run's wall time
    drafted: int = 0
    accepted: int = 0
    reported: bool = False  # the server reported speculation figures


def bench(endpoints: list[Endpoint], prompts: dict[str, str], n: int, runs: int, warmup: int = 1,
          concurrency: int = 1, progress=lambda n: None) -> dict:
    """The prompts on every endpoint, interleaved (run by run, prompt by prompt, endpoint by endpoint). With
    concurrency N, each prompt's cell sends N streams at once: that prompt and the N - 1 after it (in a cycle), so
    that the streams are different requests, as an agent's are."""
    for e in endpoints:
        e.check()
    if concurrency < 1:
        raise QuickdraftError("--concurrency must be at least 1")
    cells = {(e.url, p): Cell() for e in endpoints for p in prompts}
    first = next(iter(prompts.values()))
    for e in endpoints:
        for _ in range(warmup):
            e.complete(first, min(n, 16))
    before = {e.url: e.spec_counters() for e in endpoints}
    texts = list(prompts.values())
    for _ in range(runs):
        for index, name in enumerate(prompts):
            streams = [texts[(index + i) % len(texts)] for i in range(concurrency)]
            for e in endpoints:
                cell = cells[(e.url, name)]
                t0 = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    replies = list(pool.map(lambda text: e.complete(text, n), streams))
                wall = time.perf_counter() - t0
                cell.aggregate.append(sum(r.n for r in replies) / wall)
                for r in replies:
                    cell.decode.append(r.decode_tok_s)
                    cell.e2e.append(r.e2e_tok_s)
                    cell.ttft.append(r.ttft_s)
                    if r.drafted is not None:
                        cell.reported = True
                        cell.drafted += r.drafted
                        cell.accepted += r.accepted or 0
                progress(1)
    metrics = {}
    for e in endpoints:
        after = e.spec_counters()
        if after is not None and before[e.url] is not None:
            drafted, accepted = after[0] - before[e.url][0], after[1] - before[e.url][1]
            metrics[e.url] = {"drafted": drafted, "accepted": accepted}
    rows = []
    for (url, name), c in cells.items():
        rows.append({"url": url, "prompt": name, "decode_tok_s": _stats(c.decode), "e2e_tok_s": _stats(c.e2e),
                     "ttft_ms": _stats([1000 * t for t in c.ttft]), "aggregate_tok_s": _stats(c.aggregate),
                     "drafted": c.drafted if c.reported else None, "accepted": c.accepted if c.reported else None})
    return {"endpoints": [{"url": e.url, "model": e.model, "ignore_eos": e.sends_ignore_eos} for e in endpoints],
            "max_tokens": n, "runs": runs, "concurrency": concurrency, "rows": rows, "metrics": metrics}


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def bench_table(result: dict) -> str:
    conc = result["concurrency"]
    lines = [f"remote bench: {len({r['prompt'] for r in result['rows']})} prompts x {result['runs']} runs, "
             f"{result['max_tokens']} greedy tokens, {conc} stream{'s' if conc > 1 else ''} at once; medians "
             "(min-max); decode tok/s from the streamed chunks after the first token"]
    head = f"{'prompt':12} {'server':32} {'decode tok/s':>22} {'e2e tok/s':>10} {'TTFT ms':>8}"
    if conc > 1:
        head += f" {'aggregate tok/s':>16}"
    lines.append(head + f" {'accepted (server)':>20}")
    for r in result["rows"]:
        d = r["decode_tok_s"]
        line = (f"{r['prompt']:12} {r['url'][:32]:32} {d['median']:9.2f} ({d['min']:.1f}-{d['max']:.1f})".ljust(68)
                + f" {r['e2e_tok_s']['median']:10.2f} {r['ttft_ms']['median']:8.0f}")
        if conc > 1:
            line += f" {r['aggregate_tok_s']['median']:16.2f}"
        if r["drafted"]:
            line += f" {100 * r['accepted'] / r['drafted']:6.0f}% ({r['accepted']}/{r['drafted']})".rjust(21)
        else:
            line += f" {'-' if r['drafted'] is None else 'none drafted':>20}"
        lines.append(line)
    for url, m in result["metrics"].items():
        share = f"{100 * m['accepted'] / m['drafted']:.0f}%" if m["drafted"] else "-"
        lines.append(f"{url}: Prometheus spec_decode counters over the runs: {m['accepted']:.0f} of "
                     f"{m['drafted']:.0f} drafted tokens accepted ({share})")
    if len(result["endpoints"]) > 1:
        base = result["endpoints"][0]["url"]
        for e in result["endpoints"][1:]:
            ratios = [r["decode_tok_s"]["median"] / b["decode_tok_s"]["median"]
                      for r in result["rows"] if r["url"] == e["url"]
                      for b in result["rows"] if b["url"] == base and b["prompt"] == r["prompt"]
                      and b["decode_tok_s"]["median"]]
            if ratios:
                lines.append(f"{e['url']} against {base}: decode {statistics.median(ratios):.2f}x (median over "
                             f"prompts; {min(ratios):.2f}-{max(ratios):.2f})")
    if not all(e["ignore_eos"] for e in result["endpoints"]):
        lines.append("note: a server refused ignore_eos, so its answers may end before the token count")
    return "\n".join(lines)


# ---- verify -------------------------------------------------------------------------------------------------

def verify(spec: Endpoint, reference: Endpoint, prompts: dict[str, str], n: int) -> dict:
    """Greedy outputs of spec against reference over the prompts, token by token where both give tokens (text
    otherwise), then a seeded comparison where the reference reproduces its own seeded output."""
    spec.check()
    reference.check()
    greedy = []
    for name, prompt in prompts.items():
        a = spec.complete(prompt, n, fixed_length=False, logprobs=True, fresh=True)
        b = reference.complete(prompt, n, fixed_length=False, logprobs=True, fresh=True)
        greedy.append({"prompt": name, **_compare(a, b)})
    name, prompt = next(iter(prompts.items()))
    b1 = reference.complete(prompt, n, temperature=0.8, seed=SEED, fixed_length=False, logprobs=True, fresh=True)
    b2 = reference.complete(prompt, n, temperature=0.8, seed=SEED, fixed_length=False, logprobs=True, fresh=True)
    if b1.text != b2.text:
        seeded = {"honoured": False}
    else:
        a = spec.complete(prompt, n, temperature=0.8, seed=SEED, fixed_length=False, logprobs=True, fresh=True)
        seeded = {"honoured": True, "prompt": name, **_compare(a, b1)}
    return {"spec": spec.url, "reference": reference.url, "max_tokens": n, "greedy": greedy, "seeded": seeded,
            "identical": all(g["same"] for g in greedy) and seeded.get("same", True)}


def _compare(a: Reply, b: Reply) -> dict:
    """Where two replies part: the first differing token (or character, without tokens) and the text around it."""
    if a.tokens is not None and b.tokens is not None:
        unit, xs, ys = "token", a.tokens, b.tokens
    else:
        unit, xs, ys = "character", list(a.text), list(b.text)
    i = next((i for i, (x, y) in enumerate(zip(xs, ys)) if x != y), min(len(xs), len(ys)))
    same = xs == ys
    out = {"same": same, "unit": unit, "length": [len(xs), len(ys)],
           "drafted": a.drafted, "accepted": a.accepted}
    if not same:
        out.update(at=i, before="".join(xs[max(0, i - 8):i]), spec="".join(xs[i:i + 8]), reference="".join(ys[i:i + 8]))
    return out


def verify_report(result: dict) -> str:
    lines = [f"verify: {result['spec']} (speculative) against {result['reference']} (plain), greedy, up to "
             f"{result['max_tokens']} tokens per prompt"]
    for g in result["greedy"]:
        spec = f"; the speculative server kept {g['accepted']} of {g['drafted']} drafts" if g.get("drafted") else ""
        if g["same"]:
            lines.append(f"  {g['prompt']:12} identical, {g['length'][0]} {g['unit']}s{spec}")
        else:
            lines.append(f"  {g['prompt']:12} DIFFERENT from {g['unit']} {g['at']} (of {g['length'][0]} / "
                         f"{g['length'][1]}): after {g['before']!r}: speculative {g['spec']!r}, plain "
                         f"{g['reference']!r}{spec}")
    s = result["seeded"]
    if not s["honoured"]:
        lines.append("  seeded: skipped: the plain server does not reproduce its own seeded output (seed "
                     "ignored, or sampling not deterministic there)")
    elif s["same"]:
        lines.append(f"  seeded (T=0.8, seed {SEED}, {s['prompt']}): identical, {s['length'][0]} {s['unit']}s")
    else:
        lines.append(f"  seeded (T=0.8, seed {SEED}, {s['prompt']}): DIFFERENT from {s['unit']} {s['at']}: after "
                     f"{s['before']!r}: speculative {s['spec']!r}, plain {s['reference']!r}")
    same = sum(g["same"] for g in result["greedy"])
    if result["identical"]:
        lines.append(f"IDENTICAL: speculation left the output unchanged on all {same} prompts"
                     + (" and the seeded one" if s.get("honoured") else ""))
    else:
        lines.append(f"NOT IDENTICAL: {len(result['greedy']) - same} of {len(result['greedy'])} greedy outputs differ"
                     + ("" if s.get("same", True) else ", and the seeded one")
                     + ": this deployment's speculation is not exact here (an engine whose batched verification "
                       "rounds differently from one-token decoding parts at near ties)")
    return "\n".join(lines)
