"""Serving HTTP connections with deadlines: a connection that never completes a request head is closed.

uvicorn's h11 protocol sets a keep-alive timeout only after a response, and any byte received cancels it, so a
client that opens connections and sends their heads a byte at a time (slowloris) holds every one of them for as
long as it likes. Here each connection must deliver a complete request head within HEAD_TIMEOUT_S of being opened
or of its previous response; bodies have their own deadline (server/requests.py read_body). uvicorn's
limit_concurrency answers 503 beyond MAX_CONNECTIONS.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 20.0
MAX_CONNECTIONS = 512


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head."""

    head_timeout_s = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.cycle)

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm(self, previous) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._close_without_head, previous)

    def _close_without_head(self, previous) -> None:
        if self.cycle is previous and not self.transport.is_closing():  # no request head arrived since
            self.transport.close()


def serve(app, sock, debug: bool, head_timeout_s: float = HEAD_TIMEOUT_S) -> None:
    """Run the app on a bound socket until interrupted; a connection has head_timeout_s to send a request head."""
    import uvicorn

    protocol = type("Guarded", (GuardedH11Protocol,), {"head_timeout_s": head_timeout_s})
    config = uvicorn.Config(app, log_level="debug" if debug else "warning", access_log=debug,
                            timeout_graceful_shutdown=5, http=protocol, limit_concurrency=MAX_CONNECTIONS)
    uvicorn.Server(config).run(sockets=[sock])
