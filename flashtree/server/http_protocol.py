"""uvicorn's HTTP protocol with two changes: a request it cannot parse (`Content-Length: abc`,
broken chunked framing) gets OpenAI's error object instead of plain text, and a connection whose
request head has not arrived within the client timeout is answered 408 and closed (uvicorn
itself waits for a head forever, so slow or silent clients could hold every connection)."""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from flashtree.server.errors import error_body


def _error_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason.encode(), len(body), body))


class OpenAIErrorsProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """One connection. `head_timeout`: seconds a request head may take, counted from the
    connection's start and again after each response (set by `protocol_with_timeout`)."""

    head_timeout = 30.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:  # a closed connection's protocol is freed now
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        # uvicorn makes a new `cycle` for every request head it has parsed whole.
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_deadline,
                                                self.cycle)

    def _head_deadline(self, waiting_after) -> None:
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.write(_error_response(
                408, "Request Timeout", f"the request head did not arrive within "
                f"{self.head_timeout:g} s (the server's --client-timeout)", "request_timeout"))
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_error_response(
            400, "Bad Request", "the request is not valid HTTP/1.1 (check its Content-Length "
            "and framing)", "bad_http"))
        self.transport.close()


def protocol_with_timeout(head_timeout: float) -> type[OpenAIErrorsProtocol]:
    """The protocol class uvicorn instantiates per connection, with this head timeout."""
    return type("OpenAIErrorsProtocol", (OpenAIErrorsProtocol,), {"head_timeout": head_timeout})
