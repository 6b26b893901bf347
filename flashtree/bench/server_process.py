"""`flashtree serve` started the way users start it, as a child process on a free loopback
port: for the serving benchmarks and the server tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from flashtree.distributed.tp import free_port


def launch(model: str, log: Path, *flags: str, env: Mapping[str, str] | None = None,
           timeout: float = 120, statuses: list[int] | None = None
           ) -> tuple[str, subprocess.Popen]:
    """(base url, process) of `python -m flashtree serve MODEL FLAGS` once /health answers 200
    (each /health status seen on the way appended to `statuses`). Its output goes to `log`: a
    pipe nobody reads would fill and block the server. `env`: its whole environment (default:
    this process's). A server that exits or is not up within `timeout` seconds is stopped and
    raises RuntimeError with its log's tail."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flashtree", "serve", str(model),
                                 "--port", str(port), *flags], stdout=out,
                                stderr=subprocess.STDOUT, env=dict(env or os.environ))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            status = httpx.get(f"{base}/health", timeout=2).status_code
        except httpx.HTTPError:
            status = None
        if status is not None and statuses is not None:
            statuses.append(status)
        if status == 200:
            return base, proc
        time.sleep(0.1)
    why = "exited" if proc.poll() is not None else f"was not up within {timeout:.0f} s"
    stop_servers([proc])
    raise RuntimeError(f"`flashtree serve {model}` {why}:\n{log.read_text()[-3000:]}")


def stop_servers(procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """SIGTERM every server, then wait for each (killed after `timeout` seconds)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
