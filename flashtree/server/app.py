"""The OpenAI-compatible HTTP server (FastAPI). Bad requests get an OpenAI-style error object
with a 4xx status that says what was wrong; the engine keeps serving everything else."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashtree.engine.async_engine import AsyncEngine
from flashtree.server import responses
from flashtree.server.errors import ApiError
from flashtree.server.logprob_format import LogprobFormat
from flashtree.server.metrics import ServerMetrics
from flashtree.server.protocol import ChatCompletionRequest, CompletionRequest
from flashtree.server.tool_use import ToolUse
from flashtree.structured_output import GrammarError


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for


@dataclass
class ServerState:
    """Filled in by the loader thread; `/health` is 503 until `engine` is set."""

    engine: AsyncEngine | None = None
    llm: object | None = None
    load_error: str | None = None
    fatal: str | None = None  # the engine stopped for good (a tensor-parallel worker died)
    stop_server: Callable[[], None] | None = None  # asks the HTTP server to shut down
    metrics: ServerMetrics = field(default_factory=ServerMetrics)


def _error(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class DrainingServer(uvicorn.Server):
    """uvicorn re-raises a SIGTERM it caught once it has drained, which would end the process
    before the engine shuts down, with the signal's status instead of 0: here it does not."""

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


def _field_path(loc: tuple) -> str:
    """The request field an error is about, as OpenAI names it in `param` ("messages.0.content"),
    without pydantic's `body` root and type-union branches."""
    return ".".join(str(x) for x in loc[1:] if not (isinstance(x, str) and (
        x in ("str", "int", "function-after") or "[" in x)))


def build_app(cfg: ServerConfig, state: ServerState) -> FastAPI:
    app = FastAPI(title="flashtree", version="0.1.0")

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError):
        return _error(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, e: RequestValidationError):
        problems, params = [], []
        for err in e.errors():
            if err.get("type") == "json_invalid":
                detail = (err.get("ctx") or {}).get("error", "")
                return _error(400, f"the request body is not valid JSON ({detail} at character "
                                   f"{err['loc'][-1]}); send one JSON object")
            where = _field_path(err.get("loc", ()))
            params.append(where)
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        return _error(400, "invalid request: " + "; ".join(problems), params[0] or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail))

    @app.middleware("http")
    async def _guard(request: Request, call_next: Callable):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > cfg.max_request_bytes):
            return _error(413, f"request body is larger than {cfg.max_request_bytes} bytes")
        if cfg.api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                              code="invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
        if state.load_error is not None:
            return _error(503, f"model failed to load: {state.load_error}")
        if state.fatal is not None:
            return _error(503, f"engine stopped: {state.fatal}")
        if state.engine is None:
            return _error(503, "model is loading")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if state.engine is not None:
            state.metrics.refresh(state.engine.engine)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model",
                                            "created": 0, "owned_by": "flashtree"}]}

    def ready() -> AsyncEngine:
        if state.fatal is not None:
            raise ApiError(503, f"engine stopped: {state.fatal}")
        if state.engine is None:
            raise ApiError(503, "model is loading; retry when /health answers 200")
        return state.engine

    def check(body) -> None:
        if body.model != cfg.model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; available: "
                                f"[{cfg.model_name!r}]", "model", "model_not_found")
        if body.max_tokens is not None and body.max_tokens > cfg.max_tokens_limit:
            raise ApiError(400, f"max_tokens={body.max_tokens} exceeds this server's limit "
                                f"{cfg.max_tokens_limit}", "max_tokens")
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    def params_of(body, default_max_tokens):
        try:
            return body.sampling_params(default_max_tokens)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        engine = ready()
        check(body)
        tok = state.llm.tokenizer  # type: ignore[union-attr]
        ids = tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        params = params_of(body, 16)
        prefix = ""
        if body.echo:
            prefix = body.prompt if isinstance(body.prompt, str) else tok.decode(ids, False)
        keep = None
        if body.best_of is not None:
            if body.best_of < params.n:
                raise ApiError(400, f"best_of={body.best_of} must be >= n={params.n}", "best_of")
            if body.stream and body.best_of > params.n:
                raise ApiError(400, "best_of > n cannot be streamed", "best_of")
            # Cumulative log-probabilities rank the candidates.
            keep = params.n
            params = dataclasses.replace(params, n=body.best_of, logprobs=params.logprobs or 0)
        return await _respond(engine, ids, params, body, "text_completion", prefix, keep=keep)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        engine = ready()
        check(body)
        tok = state.llm.tokenizer  # type: ignore[union-attr]
        tools = ToolUse.of(body, tok)
        try:
            messages = [m.for_template() for m in body.messages]
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        try:
            ids = tok.apply_chat_template(messages, tools and tools.tools)
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise ApiError(400, f"chat template failed on these messages: {e}") from None
        params = params_of(body, None)
        if tools is not None:
            params = tools.constrain(params, body.response_format)
        return await _respond(engine, ids, params, body, "chat.completion", "", tools)

    async def _respond(engine: AsyncEngine, ids, params, body, kind: str, prefix: str,
                       tools: ToolUse | None = None, keep: int | None = None):
        try:
            streams, firsts = await responses.start(engine, ids, params)
        except GrammarError as e:
            if e.field.startswith("guided_json") and body.response_format is not None:
                raise ApiError(400, str(e).replace(e.field, "response_format", 1),
                               "response_format") from None
            raise ApiError(400, str(e), e.field) from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        fmt = None
        if body.num_logprobs is not None:  # asked for (best_of computes them regardless)
            fmt = LogprobFormat(state.llm.tokenizer, body.num_logprobs)  # type: ignore[union-attr]
        reply = responses.Reply(
            f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            int(time.time()), kind, cfg.model_name, len(ids), prefix, body.spec_stats, fmt,
            list(ids) if params.prompt_logprobs is not None else None, tools, keep)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(responses.events(reply, streams, firsts, include_usage),
                                     media_type="text/event-stream")
        try:
            return await responses.body(reply, streams, firsts)
        except responses.ChoiceFailed as e:
            raise ApiError(500, str(e)) from None

    return app


def load_in_background(state: ServerState, make_llm: Callable[[], object]) -> threading.Thread:
    """Load and warm the model off the server thread; /health turns 200 when done."""

    def stop(message: str) -> None:
        """The engine cannot go on: report it and shut the server down (exit status 1)."""
        state.fatal = message
        print(f"flashtree: engine stopped: {message}", flush=True)
        if state.stop_server is not None:
            state.stop_server()

    def run() -> None:
        try:
            from flashtree import SamplingParams

            llm = make_llm()
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
            state.llm = llm
            state.engine = AsyncEngine(llm.engine, on_finish=state.metrics.observe_finished,
                                       on_fatal=stop)
        except Exception as e:  # noqa: BLE001 - reported on /health and in the log
            state.load_error = f"{type(e).__name__}: {e}"
            print(f"flashtree: model failed to load: {state.load_error}", flush=True)

    thread = threading.Thread(target=run, name="flashtree-loader", daemon=True)
    thread.start()
    return thread
