"""httpx's one-call functions (get, post, options, stream) with one TLS context built once
(quickdraft.tools.remote.tls): given none, each call builds its own from the CA bundle, 25-40 ms of CPU a request, and
the server tests make hundreds."""

from __future__ import annotations

import httpx

from quickdraft.tools.remote import tls


def get(url: str, **kw) -> httpx.Response:
    return httpx.get(url, verify=tls(), **kw)


def post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, verify=tls(), **kw)


def options(url: str, **kw) -> httpx.Response:
    return httpx.options(url, verify=tls(), **kw)


def stream(method: str, url: str, **kw):
    return httpx.stream(method, url, verify=tls(), **kw)
