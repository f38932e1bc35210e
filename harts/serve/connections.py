"""Connection limits of ``harts serve``: what one client's connections may hold.

uvicorn bounds the connections and requests in progress (``limit_concurrency``: past it a new
request is answered 503), idle keep-alive connections (``timeout_keep_alive``) and the size of a
request's head (``h11_max_incomplete_event_size``), but not the time a client takes to send that
head: a connection that sends half a request line and stops is held for good, and a few hundred
of them take every slot ``limit_concurrency`` allows. ``head_timeout_protocol`` closes a
connection whose request head is not complete ``header_timeout`` seconds after it connected or
after the head's first byte; a body that stalls is the app's to refuse (``harts.serve.app``,
``--body-timeout``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from harts.serve.config import ServeConfig

__all__ = ["MAX_HEAD_BYTES", "head_timeout_protocol", "uvicorn_limits"]

#: the most bytes of a request's line and headers (uvicorn's own default; the SDK sends a few hundred)
MAX_HEAD_BYTES = 16 << 10


def head_timeout_protocol(header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, closing a connection that takes more than ``header_timeout``
    seconds to send a request's head (module docstring)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._await_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._await_head()  # part of a head: its clock runs from its first byte
            else:
                self._stop_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            if self._head_timer is None and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol


def uvicorn_limits(config: ServeConfig) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments that bound connections (module docstring)."""
    return {
        "http": head_timeout_protocol(config.header_timeout),
        "limit_concurrency": config.max_connections,
        "timeout_keep_alive": config.keep_alive_timeout,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }
