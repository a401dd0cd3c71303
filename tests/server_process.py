"""What the server tests measure a real server with (quickdraft/tools/servers.py starts it): its event loop's tasks and
metrics, raw sockets and request bytes, /health's latency while something else goes on."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests import loopback


def event_loop_tasks(url: str, headers: dict) -> int:
    """asyncio tasks alive on the server's event loop (its /metrics gauge)."""
    return int(metric(url, headers, "quickdraft_event_loop_tasks"))


def metric(url: str, headers: dict, name: str) -> float:
    text = loopback.get(url + "/metrics", headers=headers, timeout=30).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")))


def request_bytes(payload: dict, key: str, route: str = "/v1/completions") -> bytes:
    """A whole POST of a JSON body, as bytes for a raw socket."""
    data = json.dumps(payload).encode()
    return (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def raw_socket(url: str, data: bytes) -> socket.socket:
    """A connection that sent data, so that leaving is closing it."""
    host, port = url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(data)
    return s


class HealthWatch:
    """/health asked every every_s on a thread while a block runs: its latencies (s)."""

    def __init__(self, url: str, every_s: float = 0.02):
        self.url, self.every_s, self.latencies, self.stop = url, every_s, [], threading.Event()

    def __enter__(self):
        def poll():
            with httpx.Client(timeout=120) as client:
                while not self.stop.is_set():
                    start = time.perf_counter()
                    client.get(self.url + "/health")
                    self.latencies.append(time.perf_counter() - start)
                    time.sleep(self.every_s)

        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    @property
    def worst(self) -> float:
        return max(self.latencies, default=0.0)


class Together:
    """Several `quickdraft serve` processes (ServerProcess, each its argument list) started at once and stopped at
    once: each start is mostly an interpreter importing torch and its model's load, which overlap on two cores as
    they could not one after another. Together.of takes any servers' starts (each a callable giving an object with
    stop(): llama-server's too)."""

    def __init__(self, *argument_lists: tuple, **options):
        from quickdraft.tools.servers import ServerProcess

        self._start([lambda args=args: ServerProcess(*args, **options) for args in argument_lists])

    @classmethod
    def of(cls, *starts) -> "Together":
        together = cls.__new__(cls)
        together._start(list(starts))
        return together

    def _start(self, starts: list) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(starts)) as pool:
            futures = [pool.submit(start) for start in starts]
        failed = [f.exception() for f in futures if f.exception() is not None]
        self.servers = [f.result() for f in futures if f.exception() is None]
        if failed:
            self.stop()
            raise failed[0]

    def stop(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, len(self.servers))) as pool:
            list(pool.map(lambda s: s.stop(), self.servers))
