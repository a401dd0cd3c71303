"""The guarded HTTP protocol (server/connections.py) on a real uvicorn server with a tiny app and small limits, in
this process: pipelined requests stay requests, and requests that trickle their bodies are bounded. Nothing here
waits on the machine's speed: the deadlines compared are timers of one event loop."""

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from quickdraft.server.connections import guarded


async def app(scope, receive, send):
    """/slow answers after a second; every path reads the whole body first and answers with its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(str(size)))]})
    await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.fixture
def serve():
    """serve(**limits) -> (the protocol class, host, port) of a server running on a thread until the test ends."""
    servers = []

    def start(**limits):
        protocol = guarded(**limits)
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, http=protocol, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return protocol, *sock.getsockname()[:2]

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def read_all(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or timeout_s passes)."""
    s.settimeout(timeout_s)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_a_pipelined_request_is_not_taken_for_a_connection_waiting_for_a_head(serve):
    """Two requests in one packet: the second starts as the first's response completes. It is a request, not a
    connection waiting for a head: the head deadline (0.3 s) must not close it while it runs (1 s)."""
    protocol, host, port = serve(head_timeout_s=0.3)
    with socket.create_connection((host, port)) as s:
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = read_all(s)
    print(f"\ntwo pipelined requests: {answers.count(b'HTTP/1.1 200')} answered")
    assert answers.count(b"HTTP/1.1 200") == 2, answers


def test_requests_that_trickle_their_bodies_are_bounded(serve):
    """Heads complete, bodies a byte at a time: past the bound, the request that has been reading longest is
    closed; a real request (its body with its head) is answered."""
    protocol, host, port = serve(max_reading=2)
    slow = []
    try:
        for i in range(3):
            s = socket.create_connection((host, port))
            s.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nConnection: close\r\n\r\na")
            slow.append(s)
            wait_for(lambda: len(protocol.reading) == min(i + 1, 2))  # the server has its head
        assert read_all(slow[0]) == b""  # the longest reading was closed
        with socket.create_connection((host, port)) as s:
            s.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
            assert read_all(s).endswith(b"\r\n\r\n5")
        slow[1].sendall(b"b" * 9)  # the others were kept, and are answered once their bodies arrive
        assert read_all(slow[1]).startswith(b"HTTP/1.1 200")
        assert len(protocol.reading) == 1
    finally:
        for s in slow:
            s.close()
