"""Serving HTTP connections with deadlines, and bounded shares for connections that have not sent a request head and
for requests still sending their body.

uvicorn's h11 protocol sets a keep-alive timeout only after a response, and any byte received cancels it, so a
client that opens connections and sends their heads a byte at a time (slowloris) holds every one of them for as
long as it likes. Here each connection must deliver a complete request head within HEAD_TIMEOUT_S of being opened
or of its previous response; bodies have their own deadline (server/requests.py read_body).

A deadline alone only makes such a client reconnect: with uvicorn's limit_concurrency counting every open
connection, 600 of them kept every real request (and /health) at 503. So the connections still waiting for a head
(new ones, and idle keep-alive ones between requests) are at most MAX_WAITING_HEADS; one more closes the one that
has waited longest. That is nginx's answer (when it runs out of connections it closes the idle and
waiting-for-request ones, oldest first, to serve new ones); llama-server's fixed pool of HTTP threads has none, and
a per-address limit would not help on loopback, where everyone is 127.0.0.1.

The same client can send complete heads and then trickle their bodies for the body's deadline (60 s). A real
client's body follows its head at once (in the same packet, as a rule), so requests still reading their body are
at most MAX_READING_BODIES; one more closes the one that has been reading longest (its handler sees the client
gone). A minimum rate alone (Apache's mod_reqtimeout) would not bound them: hundreds of connections each meet a
low rate.

What is left is requests: uvicorn answers 503 to a request head that arrives while MAX_REQUESTS +
MAX_WAITING_HEADS connections are open. With at most MAX_WAITING_HEADS of them waiting for a head, that admits at
least MAX_REQUESTS requests (up to MAX_REQUESTS + MAX_WAITING_HEADS while fewer connections wait), of which at most
MAX_READING_BODIES still send their body.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 20.0
MAX_WAITING_HEADS = 256
MAX_READING_BODIES = 128
MAX_REQUESTS = 512


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head, and room for new connections made by closing
    the longest-waiting connection without a head, or the longest-reading request body (see the module's note)."""

    head_timeout_s = HEAD_TIMEOUT_S
    max_waiting = MAX_WAITING_HEADS
    max_reading = MAX_READING_BODIES
    # the server's connections without a head, and those whose request's body is still coming, longest first: one
    # pair for every server of this class (guarded() makes a class per server)
    waiting: dict = {}
    reading: dict = {}
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(None)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request head arrived: a request now, not a waiting connection
            self.waiting.pop(self, None)
        self._track_body()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()  # may start a pipelined request already (handle_events)
        if self.cycle is cycle and not self.transport.is_closing():  # waiting for the next head
            self._arm(cycle)

    def connection_lost(self, exc) -> None:
        self.waiting.pop(self, None)
        self.reading.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm(self, previous) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._close_without_head, previous)
        self.reading.pop(self, None)
        _enter(self.waiting, self, self.max_waiting)

    def _track_body(self) -> None:
        """Count this connection among those reading a body while its request's body is still coming."""
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.disconnected and self.conn.our_state is not h11.DONE:
            if self not in self.reading:
                _enter(self.reading, self, self.max_reading)
        else:
            self.reading.pop(self, None)

    def _close_without_head(self, previous) -> None:
        if self.cycle is previous and not self.transport.is_closing():  # no request head arrived since
            self.waiting.pop(self, None)
            self.transport.close()


def _enter(registry: dict, connection: GuardedH11Protocol, limit: int) -> None:
    """Add a connection last to a registry; past its limit, close the ones that have been there longest."""
    registry.pop(connection, None)
    registry[connection] = None
    while len(registry) > limit:
        oldest = next(iter(registry))
        registry.pop(oldest)
        oldest.transport.close()


def guarded(head_timeout_s: float = HEAD_TIMEOUT_S, max_waiting: int = MAX_WAITING_HEADS,
            max_reading: int = MAX_READING_BODIES) -> type[GuardedH11Protocol]:
    """The protocol class for one server, with its own registries of connections."""
    return type("Guarded", (GuardedH11Protocol,), {"head_timeout_s": head_timeout_s, "max_waiting": max_waiting,
                                                   "max_reading": max_reading, "waiting": {}, "reading": {}})


def serve(app, sock, debug: bool, head_timeout_s: float = HEAD_TIMEOUT_S) -> None:
    """Run the app on a bound socket until interrupted; a connection has head_timeout_s to send a request head."""
    import uvicorn

    # uvicorn's limit counts open connections as well as requests: see the module's note
    config = uvicorn.Config(app, log_level="debug" if debug else "warning", access_log=debug,
                            timeout_graceful_shutdown=5, http=guarded(head_timeout_s),
                            limit_concurrency=MAX_REQUESTS + MAX_WAITING_HEADS)
    uvicorn.Server(config).run(sockets=[sock])
