"""What stands between a connection and the API: a pure ASGI middleware that checks the API key,
bounds the request body while it streams in, gives every answer a request id, cancels a request
whose client left or that outlived the shutdown drain, and answers any unexpected error with
OpenAI's error object (the traceback goes to the log under the request id, never to the client).
Also the API key's sources."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import stat
import sys
import uuid
from collections.abc import Mapping

from flashtree.server.errors import error_body, internal_error_message, log

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_KEY = "flashtree.request_id"  # the request id in the ASGI scope, for the handlers
# A route's own ending for its cut stream, in the ASGI scope: (message, code) -> the last events.
STREAM_ENDING_KEY = "flashtree.stream_ending"
_PROTECTED_PREFIX = "/v1/"  # paths that need the API key (/health and /metrics stay open)


def chat_stream_ending(message: str, code: str) -> str:
    """The last events of a cut chat or completions stream: an error event and [DONE]."""
    return f"data: {json.dumps(error_body(500, message, code=code))}\n\ndata: [DONE]\n\n"


class DrainDeadline:
    """Expires once when the shutdown drain runs out. Requests wait for it through a future of
    their own event loop (an asyncio.Event would bind to the first loop that waits on it)."""

    def __init__(self) -> None:
        self.expired = False
        self._waiters: set[asyncio.Future] = set()

    def expire(self) -> None:
        self.expired = True
        for waiter in list(self._waiters):
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits
                waiter.get_loop().call_soon_threadsafe(_resolve, waiter)

    async def wait(self) -> None:
        if self.expired:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await waiter
        finally:
            self._waiters.discard(waiter)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Guard:
    """ASGI middleware around the FastAPI app (inside Starlette's own error middleware, which
    then never sees an exception). `drain` expires when the shutdown drain runs out."""

    def __init__(self, app, max_request_bytes: int, api_key: str | None,
                 drain: DrainDeadline, client_timeout: float) -> None:
        self.app, self.max_request_bytes = app, max_request_bytes
        self.api_key, self.drain, self.client_timeout = api_key, drain, client_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(scope, send)
        refusal = self._refusal(scope)
        if refusal is None:
            try:
                body, refusal = await asyncio.wait_for(self._read_body(receive),
                                                       self.client_timeout)
            except asyncio.TimeoutError:
                body, refusal = None, (408, f"the request body did not arrive within "
                                            f"{self.client_timeout:g} s (the server's "
                                            "--client-timeout)", "request_timeout")
            if body is None and refusal is None:
                return  # the client left while sending its body
        if refusal is not None:  # the body is left unread: close rather than drain it
            await exchange.answer(*refusal, close=True)
            return
        await exchange.run(self.app, body, receive, self.drain)

    def _refusal(self, scope) -> tuple | None:
        """(status, message, code) for a request refused on its headers alone, else None."""
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith(_PROTECTED_PREFIX):
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return (401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                        "invalid_api_key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_request_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> tuple:
        return (413, f"request body is larger than {self.max_request_bytes} bytes "
                     "(the server's --max-request-bytes)", "request_too_large")

    async def _read_body(self, receive) -> tuple[bytes | None, tuple | None]:
        """The whole body, read until it passes the limit (chunked or not): (body, None),
        (None, the 413 refusal), or (None, None) when the client disconnected."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return None, self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


class _Exchange:
    """One request's answer as it goes out: whether it started, is a stream, is complete."""

    def __init__(self, scope, send) -> None:
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"")
        # A client's id is kept when it is a short token (it goes into the log as is).
        self.rid = (given.decode() if 0 < len(given) <= 128
                    and all(0x21 <= c <= 0x7E for c in given) else uuid.uuid4().hex)
        scope[REQUEST_ID_KEY] = self.rid
        self.scope, self._send = scope, send
        self.started = self.streaming = self.complete = False
        self.client_gone = asyncio.Event()  # made here, inside the request's own loop

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(),
                                                      self.rid.encode())]
            message = {**message, "headers": headers}
            self.started = True
            self.streaming = dict(headers).get(b"content-type", b"").startswith(
                b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def answer(self, status: int, message: str, code: str | None = None,
                     close: bool = False) -> None:
        """OpenAI's error object; `close`: uvicorn then closes the connection after it
        instead of reading the rest of the body to keep the connection alive."""
        body = json.dumps(error_body(status, message, code=code)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def end_stream(self, message: str, code: str) -> None:
        """End a started event stream the way its route ends a failed one."""
        ending = self.scope.get(STREAM_ENDING_KEY, chat_stream_ending)
        await self.send({"type": "http.response.body",
                         "body": ending(message, code).encode()})

    async def run(self, app, body: bytes, receive, drain: DrainDeadline) -> None:
        """Run the app on the body read; cancel it when the client disconnects or the drain
        runs out, whichever comes first, and answer what it could not."""
        serving = asyncio.create_task(app(self.scope, self._replay(body), self.send))
        watchers = {asyncio.create_task(self._watch_disconnect(receive)),
                    asyncio.create_task(drain.wait())}
        try:
            await self._serve_until_stopped(serving, watchers, drain)
        finally:  # also when uvicorn itself cancels this request
            for task in (serving, *watchers):
                task.cancel()
            await asyncio.gather(serving, *watchers, return_exceptions=True)
        if serving.cancelled():
            if drain.expired and not self.client_gone.is_set():
                await self._cut()
            return
        if serving.exception() is not None:
            await self._failed(serving.exception())

    async def _serve_until_stopped(self, serving: asyncio.Task, watchers: set[asyncio.Task],
                                   drain: DrainDeadline) -> None:
        """Wait for the app; cancel it only when the client is gone or the drain expired (a
        watcher that failed is logged and no longer watched)."""
        pending = {serving, *watchers}
        while not serving.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for watcher in done - {serving}:
                if not watcher.cancelled() and watcher.exception() is not None:
                    log.warning("request %s: a watcher failed; the request goes on", self.rid,
                                exc_info=watcher.exception())
            stop = self.client_gone.is_set() or drain.expired
            if stop and not serving.done() and not self.complete:
                serving.cancel()
                await asyncio.wait([serving])

    def _replay(self, body: bytes):
        """The app's `receive`: the body read, then the disconnect once the client left."""
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.client_gone.wait()
            return {"type": "http.disconnect"}

        return receive

    async def _watch_disconnect(self, receive) -> None:
        """After the body, the server's next message is the disconnect."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone.set()

    async def _cut(self) -> None:
        message = ("the server is shutting down and this request did not finish within its "
                   "drain timeout (--shutdown-timeout)")
        if not self.started:
            await self.answer(503, message, "shutdown")
        elif self.streaming and not self.complete:
            await self.end_stream(message, "shutdown")

    async def _failed(self, error: BaseException) -> None:
        log.error("request %s failed", self.rid, exc_info=error)
        message = internal_error_message(self.rid)
        if not self.started:
            await self.answer(500, message, "internal_error")
        elif self.streaming and not self.complete:
            await self.end_stream(message, "internal_error")


def read_api_key(flag: str | None, path: str | None, environ: Mapping[str, str]) -> str | None:
    """The API key from `--api-key-file` (readable by no other user; one trailing newline
    dropped), `--api-key` (shows in `ps`: a warning) or FLASHTREE_API_KEY, in that order; None
    when none is given. Raises ValueError for a key that cannot be used."""
    if flag is not None and path is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if path is not None:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXO | stat.S_IWGRP):
            raise ValueError(f"--api-key-file {path} is open to other users (mode "
                             f"{stat.S_IMODE(mode):o}); chmod 600 (or 640 for a group)")
        with open(path, encoding="utf-8") as f:
            key = f.read().removesuffix("\n").removesuffix("\r")
        where = f"--api-key-file {path}"
    elif flag is not None:
        print("flashtree: warning: --api-key shows in `ps` to every user of this machine; use "
              "FLASHTREE_API_KEY or --api-key-file", file=sys.stderr, flush=True)
        key, where = flag, "--api-key"
    elif "FLASHTREE_API_KEY" in environ:
        key, where = environ["FLASHTREE_API_KEY"], "FLASHTREE_API_KEY"
    else:
        return None
    if not key or key != key.strip():
        raise ValueError(f"the API key from {where} is empty or has surrounding whitespace")
    return key
