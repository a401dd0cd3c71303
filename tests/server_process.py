"""`quickdraft serve` as a real child process on a free loopback port, for tests and the load test, and what the
server tests measure it with."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 300, cwd=None):
        """cwd: the checkout whose quickdraft serves (another revision's, for a before/after run)."""
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "quickdraft", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=cwd,
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        self.printed = []
        while True:
            try:
                line = lines.get(timeout=startup_timeout)
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"the server did not start in {startup_timeout} s:\n{self.stderr()}") from None
            if line is None:
                raise RuntimeError(f"the server exited with {self.proc.wait()}:\n{self.stderr()}")
            self.printed.append(line)
            if line.startswith("quickdraft: serving"):
                self.base_url = line.split(" at ")[-1].strip()  # http://127.0.0.1:PORT/v1
                self.url = self.base_url.removesuffix("/v1")
            if line.startswith("try: curl"):
                break

    @property
    def pid(self) -> int:
        return self.proc.pid

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()[-5000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# ---- what the server tests measure with ------------------------------------------------------------------------

def event_loop_tasks(url: str, headers: dict) -> int:
    """asyncio tasks alive on the server's event loop (its /metrics gauge)."""
    return int(metric(url, headers, "quickdraft_event_loop_tasks"))


def metric(url: str, headers: dict, name: str) -> float:
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
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
