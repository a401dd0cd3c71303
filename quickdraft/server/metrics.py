"""Prometheus metrics, named after vLLM's where one exists (spec_decode_num_draft_tokens, ...)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from quickdraft.engine import Timings
from quickdraft.speculative.stats import SpeculationStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class Metrics:
    """One registry per server (tests run several apps in one process)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "quickdraft_"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Tokens drafted", registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                       registry=r)
        self.drafts = Counter(p + "spec_decode_num_drafts", "Speculative rounds (draft -> verify)", registry=r)
        # per drafter source (draft, ngram, suffix, mtp, ...): acceptance is accepted / draft tokens, the mean accepted
        # length (accepted + rounds) / rounds
        self.source_draft_tokens = Counter(p + "spec_decode_source_draft_tokens", "Tokens drafted, by source",
                                           ["source"], registry=r)
        self.source_accepted_tokens = Counter(p + "spec_decode_source_accepted_tokens",
                                              "Drafted tokens accepted, by source", ["source"], registry=r)
        self.source_drafts = Counter(p + "spec_decode_source_drafts", "Speculative rounds, by source", ["source"],
                                     registry=r)
        self.finished = Counter(p + "request_success", "Requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter(p + "request_rejected", "Requests refused before generation, by HTTP status",
                                ["status"], registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests generating now", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting for the engine", registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Request latency, queue included",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Time waiting for the engine",
                                    buckets=LATENCY_BUCKETS, registry=r)
        # what a request leaves behind when something forgets it: a handler that waits forever (tests compare it
        # before and after)
        self.tasks = Gauge(p + "event_loop_tasks", "asyncio tasks alive on the server's event loop", registry=r)
        self.compiles = Gauge(p + "grammar_compiles", "Constraints compiling or waiting for the grammar compiler",
                              registry=r)
        self.batch_rows = Histogram(p + "batch_rows", "Rows per target pass (every running request's, together)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token (prefill included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        # the kept slots (runtime/slots.py), as vLLM counts its prefix cache: prompt tokens looked up and found
        self.cache_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the kept slots",
                                     registry=r)
        self.cache_hits = Counter(p + "prefix_cache_hits", "Prompt tokens taken from a cache (a kept slot, or a "
                                  "request running beside it), not prefilled", registry=r)
        self.cache_requests = Counter(p + "prefix_cache_requests_reused", "Requests that reused a kept slot's tokens",
                                      registry=r)
        self.cache_evictions = Gauge(p + "prefix_cache_evictions", "Kept conversations given up for others: forgotten "
                                     "for a new one, or dropped to stay within --cache-ram", registry=r)
        self.cache_bytes = Gauge(p + "prefix_cache_bytes", "Bytes the kept slots hold (--cache-ram bounds them)",
                                 registry=r)
        # on a GPU: conversations its slots gave up, kept in host memory (runtime/slots.HostCopies)
        self.host_stored = Gauge(p + "prefix_cache_host_stored", "Conversations copied from a slot to host memory",
                                 registry=r)
        self.host_restored = Gauge(p + "prefix_cache_host_restores", "Conversations copied back into a slot from "
                                   "host memory rather than prefilled", registry=r)
        self.host_damaged = Gauge(p + "prefix_cache_host_damaged", "Host copies that no longer matched their "
                                  "checksum: dropped, the prompt prefilled", registry=r)
        self.host_bytes = Gauge(p + "prefix_cache_host_bytes", "Bytes of the host copies (--cache-ram bounds them "
                                "on a GPU)", registry=r)

    def record_generation(self, finish_reason: str, completion_n: int, timings: Timings, stats: SpeculationStats) -> None:
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(timings.prompt_n)
        self.generation_tokens.inc(completion_n)
        self.draft_tokens.inc(stats.draft_n)
        self.accepted_tokens.inc(stats.draft_n_accepted)
        self.drafts.inc(stats.rounds)
        for source, rounds in stats.sources.items():
            self.source_drafts.labels(source).inc(rounds)
            self.source_draft_tokens.labels(source).inc(stats.drafted_by[source])
            self.source_accepted_tokens.labels(source).inc(stats.accepted_by[source])
        self.cache_queries.inc(timings.prompt_n)
        self.cache_hits.inc(timings.cache_n)
        if timings.cache_n:
            self.cache_requests.inc()
        if completion_n:
            self.ttft.observe(timings.ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
