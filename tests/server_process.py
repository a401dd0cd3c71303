"""`quickdraft serve` as a real child process on a free loopback port, for tests and the load test."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading

import httpx


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 300):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "quickdraft", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
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
