"""Servers as real child processes on free loopback ports: `quickdraft serve` (ServerProcess) and llama.cpp's
llama-server (LlamaServer), for the benchmarks that compare them and the tests that drive them over HTTP."""

from __future__ import annotations

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

from quickdraft.tools.remote import tls


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
        return httpx.get(self.url + path, timeout=30, **{"verify": tls(), **kw})

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


class LlamaServer:
    """llama.cpp's llama-server on a free loopback port, with these flags (-c 2048 unless they give -c)."""

    def __init__(self, binary, *flags):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(binary), *flags, "--host", "127.0.0.1", "--port", str(self.port),
                                      *(() if "-c" in flags else ("-c", "2048")), "-t", str(os.cpu_count() or 2)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5, verify=tls()).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("llama-server did not start in 300 s")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
