"""The idle-connection timeouts of server/process.py, in-process against the pinned uvicorn.

`_H11` subclasses uvicorn's private H11Protocol (uvicorn has no option that bounds the time to a
complete request), so uvicorn is pinned to one release (pyproject.toml). These tests drive the
protocol with a fake transport on a real event loop: they fail, naming the release, when an install
drifts outside the pin or the private state the subclass reads changes. test_hardening.py checks
the same behaviour through real sockets."""

from __future__ import annotations

import asyncio
from importlib.metadata import requires, version

import pytest
import uvicorn
from packaging.requirements import Requirement
from uvicorn.server import ServerState

from specdecode.server.process import _H11

TIMEOUT = 0.5  # keep-alive seconds: the time a client has for each step of its request


def test_uvicorn_is_the_pinned_release():
    pins = [Requirement(r) for r in requires("specdecode") if r.startswith("uvicorn")]
    assert pins and all(version("uvicorn") in pin.specifier for pin in pins), (version("uvicorn"), pins)


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed, self.written = False, b""

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def slow_app(scope, receive, send) -> None:
    """Reads the body, then takes 3 timeouts to answer (a generation: the client sends nothing meanwhile)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(3 * TIMEOUT)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def connect(loop) -> tuple[_H11, FakeTransport]:
    config = uvicorn.Config(slow_app, http=_H11, timeout_keep_alive=TIMEOUT, log_level="warning", lifespan="off")
    protocol = _H11(config, ServerState(), {}, _loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


HEAD = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n"


@pytest.mark.parametrize("sent, closed", [
    ([], True),  # connects and says nothing
    ([HEAD[:20]], True),  # half a head, then nothing
    ([HEAD, b"ab"], True),  # the head and half the body, then nothing
    ([HEAD, b"abcd"], False),  # a whole request: the app takes its time, the connection stays
])
def test_a_stalled_request_is_cut_and_a_complete_one_is_served(sent, closed):
    async def scenario() -> FakeTransport:
        protocol, transport = connect(asyncio.get_running_loop())
        for data in sent:
            protocol.data_received(data)
            await asyncio.sleep(TIMEOUT / 2)
        await asyncio.sleep(2 * TIMEOUT)  # past the timeout, while a whole request's app still works
        assert transport.closed is closed
        if not closed:
            await asyncio.sleep(2 * TIMEOUT)
            assert transport.written.startswith(b"HTTP/1.1 200") and transport.written.endswith(b"ok")
        protocol.connection_lost(None)
        return transport

    asyncio.run(scenario())


def test_a_body_that_keeps_coming_is_not_cut():
    """Each piece of a body restarts the clock: a slow upload that keeps sending is served."""
    async def scenario() -> FakeTransport:
        protocol, transport = connect(asyncio.get_running_loop())
        protocol.data_received(HEAD)
        for piece in (b"a", b"b", b"c", b"d"):
            await asyncio.sleep(0.7 * TIMEOUT)  # 2.8 timeouts in all, never one without a piece
            assert not transport.closed
            protocol.data_received(piece)
        await asyncio.sleep(4 * TIMEOUT)
        assert transport.written.startswith(b"HTTP/1.1 200")
        protocol.connection_lost(None)
        return transport

    asyncio.run(scenario())
