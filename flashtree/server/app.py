"""The OpenAI-compatible HTTP server (FastAPI). Bad requests get an OpenAI-style error object
with a 4xx status that says what was wrong; the engine keeps serving everything else."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from flashtree.engine.async_engine import AsyncEngine
from flashtree.server.error_handlers import add_error_handlers
from flashtree.server.guard import Guard
from flashtree.server.http_protocol import protocol_with_timeout
from flashtree.server.routes import Routes
from flashtree.server.state import ServerConfig, ServerState

# Seconds uvicorn waits past the drain before it cancels what is left without an answer: the
# Guard answers the requests it cut within them.
UVICORN_GRACE = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn re-raises a SIGTERM it caught once it has drained, which would end the process
    before the engine shuts down, with the signal's status instead of 0: here it does not. The
    drain has a deadline: requests still running then are cut with an answer (`Guard`), before
    uvicorn's own timeout, `UVICORN_GRACE` later, would cancel them without one."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout

    async def shutdown(self, sockets=None) -> None:
        asyncio.get_running_loop().call_later(self.drain_timeout, self.state.drain.expire)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


def make_server(cfg: ServerConfig, state: ServerState, host: str, port: int) -> DrainingServer:
    """The HTTP server `flashtree serve` runs: SIGTERM drains for `cfg.shutdown_timeout`."""
    config = uvicorn.Config(build_app(cfg, state), host=host, port=port, log_level="info",
                            http=protocol_with_timeout(cfg.client_timeout),
                            timeout_graceful_shutdown=cfg.shutdown_timeout + UVICORN_GRACE)
    return DrainingServer(config, state, cfg.shutdown_timeout)


def build_app(cfg: ServerConfig, state: ServerState) -> FastAPI:
    docs = cfg.enable_docs  # off by default: the key does not guard them (see docs/deploy.md)
    app = FastAPI(title="flashtree", version="0.1.0", docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.add_middleware(Guard, max_request_bytes=cfg.max_request_bytes, api_key=cfg.api_key,
                       drain=state.drain, client_timeout=cfg.client_timeout)
    add_error_handlers(app)
    Routes(cfg, state).add_to(app)
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
