"""OpenAI's error object, the error a request handler raises to answer with it, and the
answer to an internal failure: a generic message naming the request id, the detail in the log
under that id (never sent to the client)."""

from __future__ import annotations

import logging

log = logging.getLogger("flashtree.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class EngineFailed(RuntimeError):
    """The engine failed a request; the message says why, for the log only."""


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def internal_error_message(request_id: str) -> str:
    """What the client is told of an internal failure."""
    return f"internal server error; the server logged it under request id {request_id}"


def report_engine_failure(request_id: str, detail: str) -> str:
    """Log an engine failure's detail under the request id; the client's message for it."""
    log.error("request %s failed in the engine: %s", request_id, detail)
    return internal_error_message(request_id)
