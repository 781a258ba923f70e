"""Running the app under uvicorn: a bounded drain on shutdown, clean signals, connection timeouts.

Plain uvicorn, on SIGTERM/SIGINT, waits for every in-flight request however long
the queue is; ignores a second SIGTERM; and on a second SIGINT abandons requests
mid-flight (500s, tracebacks). Here the first signal stops accepting connections
and starts a drain of `drain_seconds`, after which the jobs still running or
waiting end with a 503 (non-streaming) or an error event (streams); a second
signal of either kind ends them at once. Either way every handler answers, the
connections close and the process exits normally (status 0).
"""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

SHUTDOWN_MESSAGE = "the server is shutting down"


class _H11(H11Protocol):
    """uvicorn times a connection out only between requests (timeout_keep_alive); one that never completes
    a request (a client that connects and says nothing, sends its headers slowly, or stops sending its
    body) would be held forever. Here the same timeout also applies from connecting, or from the last
    response, to a complete request head, and then to each piece of its body (a slow upload that keeps
    sending is not cut; one that stalls is).

    It reads H11Protocol's private state (`cycle`, `flow`, `timeout_keep_alive`, `loop`): uvicorn is
    pinned to the release it is tested against (pyproject.toml, tests/server/test_process.py)."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self._in_request() and self.cycle.more_body:  # its body is arriving: the clock restarts with each piece
            self._arm_head_timer()
        elif self._head_timer is not None and self._in_request():  # all of it is in: the app has it
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self._in_request() and not self.cycle.more_body):
            return
        if self._in_request() and self.flow.read_paused:  # the app has not read what came: not the client's stall
            self._arm_head_timer()
            return
        self.transport.close()  # the app, if it was reading the body, sees the client leave


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_seconds: float) -> None:
        super().__init__(config)
        self.jobs, self.drain_seconds = app.state.jobs, drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # not uvicorn's: it force-exits mid-request on a second SIGINT, ignores a second SIGTERM, and
        # re-raises the signal after a clean shutdown (a KeyboardInterrupt traceback)
        if self.should_exit and self._loop is not None:
            self._loop.call_soon_threadsafe(self.jobs.abort_all, SHUTDOWN_MESSAGE)
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        message = f"{SHUTDOWN_MESSAGE} (its drain limit of {self.drain_seconds:g} s is over)"
        timer = asyncio.get_running_loop().call_later(self.drain_seconds, self.jobs.abort_all, message)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(app: FastAPI, host: str, port: int, drain_seconds: float = 10, keep_alive_seconds: int = 5) -> None:
    # timeout_graceful_shutdown is only a backstop: after the drain every handler answers within a round
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=_H11,
                            timeout_keep_alive=keep_alive_seconds, timeout_graceful_shutdown=drain_seconds + 10)
    _Server(config, app, drain_seconds).run()
