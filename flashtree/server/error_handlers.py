"""The app's answers to the errors its handlers raise and to bodies that fail validation:
OpenAI's error object, `param` naming the field at fault."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashtree.server.errors import ApiError, EngineFailed, log, report_engine_failure
from flashtree.server.routes import error_response, request_id


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(EngineFailed, _engine_failed)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)


async def _api_error(request: Request, e: ApiError):
    if e.status >= 500:
        log.error("request %s: %d %s", request_id(request), e.status, e.message)
    return error_response(e.status, e.message, e.param, e.code)


async def _engine_failed(request: Request, e: EngineFailed):
    """A request the engine failed: the detail to the log, a generic 500 to the client."""
    message = report_engine_failure(request_id(request), str(e))
    return error_response(500, message, code="internal_error")


async def _invalid(_request: Request, e: RequestValidationError):
    problems, params = [], []
    for err in e.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON ({detail} at "
                                       f"character {err['loc'][-1]}); send one JSON object")
        where = _field_path(err.get("loc", ()))
        params.append(where)
        problems.append(f"{where or 'body'}: {err.get('msg')}")
    return error_response(400, "invalid request: " + "; ".join(problems), params[0] or None)


async def _http(_request: Request, e: StarletteHTTPException):
    return error_response(e.status_code, str(e.detail))


def _field_path(loc: tuple) -> str:
    """The request field an error is about, as OpenAI names it in `param` ("messages.0.content"),
    without pydantic's `body` root and type-union branches."""
    return ".".join(str(x) for x in loc[1:] if not (isinstance(x, str) and (
        x in ("str", "int", "function-after") or "[" in x)))
