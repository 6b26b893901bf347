"""The server's settings and its state shared by the loader thread, the routes and the
shutdown."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flashtree.engine.async_engine import AsyncEngine
from flashtree.server.guard import DrainDeadline
from flashtree.server.metrics import ServerMetrics


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    shutdown_timeout: float = 75.0  # seconds SIGTERM waits for running requests (the drain)
    enable_docs: bool = False  # serve /docs, /redoc and /openapi.json
    client_timeout: float = 30.0  # seconds a request's head, then its body, may take to arrive


@dataclass
class ServerState:
    """Filled in by the loader thread; `/health` is 503 until `engine` is set."""

    engine: AsyncEngine | None = None
    llm: object | None = None
    load_error: str | None = None
    fatal: str | None = None  # the engine stopped for good (a tensor-parallel worker died)
    stop_server: Callable[[], None] | None = None  # asks the HTTP server to shut down
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    drain: DrainDeadline = field(default_factory=DrainDeadline)  # expired: cut what still runs
