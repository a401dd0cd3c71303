"""Serving HTTP connections with deadlines and a bounded share for connections that have not sent a request head.

uvicorn's h11 protocol sets a keep-alive timeout only after a response, and any byte received cancels it, so a
client that opens connections and sends their heads a byte at a time (slowloris) holds every one of them for as
long as it likes. Here each connection must deliver a complete request head within HEAD_TIMEOUT_S of being opened
or of its previous response; bodies have their own deadline (server/requests.py read_body).

A deadline alone only makes such a client reconnect: with uvicorn's limit_concurrency counting every open
connection, 600 of them kept every real request (and /health) at 503. So the connections still waiting for a head
(new ones, and idle keep-alive ones between requests) are at most MAX_WAITING_HEADS; one more closes the one that
has waited longest. That is nginx's answer (when it runs out of connections it closes the idle and
waiting-for-request ones, oldest first, to serve new ones); llama-server's fixed pool of HTTP threads has none, and
a per-address limit would not help on loopback, where everyone is 127.0.0.1. Requests whose head has arrived are
never closed this way: they are bounded by MAX_REQUESTS (503 beyond, uvicorn's limit, which then counts them alone).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 20.0
MAX_WAITING_HEADS = 256
MAX_REQUESTS = 512


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head, and room for new connections made by closing
    the longest-waiting connection without a head (see the module's note)."""

    head_timeout_s = HEAD_TIMEOUT_S
    max_waiting = MAX_WAITING_HEADS
    waiting: dict  # the server's connections without a head, longest-waiting first (made per server: serve)
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(None)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request head arrived: a request now, not a waiting connection
            self.waiting.pop(self, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.cycle)

    def connection_lost(self, exc) -> None:
        self.waiting.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm(self, previous) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._close_without_head, previous)
        self.waiting.pop(self, None)
        self.waiting[self] = None
        while len(self.waiting) > self.max_waiting:
            oldest = next(iter(self.waiting))
            self.waiting.pop(oldest)
            oldest.transport.close()

    def _close_without_head(self, previous) -> None:
        if self.cycle is previous and not self.transport.is_closing():  # no request head arrived since
            self.waiting.pop(self, None)
            self.transport.close()


def serve(app, sock, debug: bool, head_timeout_s: float = HEAD_TIMEOUT_S) -> None:
    """Run the app on a bound socket until interrupted; a connection has head_timeout_s to send a request head."""
    import uvicorn

    protocol = type("Guarded", (GuardedH11Protocol,), {"head_timeout_s": head_timeout_s, "waiting": {}})
    # uvicorn's limit counts open connections as well as requests: with at most MAX_WAITING_HEADS of them waiting
    # for a head, this limit is reached only by MAX_REQUESTS requests
    config = uvicorn.Config(app, log_level="debug" if debug else "warning", access_log=debug,
                            timeout_graceful_shutdown=5, http=protocol,
                            limit_concurrency=MAX_REQUESTS + MAX_WAITING_HEADS)
    uvicorn.Server(config).run(sockets=[sock])
