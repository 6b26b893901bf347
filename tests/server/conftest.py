"""A real `flashtree serve` process on loopback, serving a tiny random Llama that carries the
default model's real tokenizer and chat template (fast on CPU, real text handling)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

API_KEY = "test-key"
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model, drafter, statuses: list[int] | None = None, extra: tuple = ()
                 ) -> tuple[str, subprocess.Popen]:
    """Start `flashtree serve` the way users do and wait until /health answers 200 (every
    /health status seen on the way is appended to `statuses`)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashtree", "serve", str(model), "--draft", str(drafter),
         "--served-model-name", MODEL, "--port", str(port), "--api-key", API_KEY,
         "--device", "cpu", "--max-model-len", "256", "--max-tokens-limit", "200",
         "--max-request-bytes", "20000", "--max-num-seqs", "64", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            status = httpx.get(f"{base}/health", timeout=2).status_code
            if statuses is not None:
                statuses.append(status)
            if status == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("server did not become healthy")
    return base, proc


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every server, then wait for each (killed after a minute)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def metric(base: str, name: str) -> float:
    """The server's /metrics value of `name` (a series name, or one with its labels), summed
    over its labelled series."""
    text = httpx.get(f"{base}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


@pytest.fixture(scope="session")
def server(tiny_chat_model):
    """(base_url, process) of a speculative (ddtree) server with an API key."""
    base, proc = start_server(*tiny_chat_model)
    yield base, proc
    stop_servers([proc])


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def spec_clients(tiny_chat_model):
    """An `openai` client per spec mode ("none", "dflash", "ddtree"), each on a server of its
    own with the fixed policy (speculation on at every step), for features that must give
    plain decoding's answers in every mode."""
    from openai import OpenAI

    procs, clients = [], {}
    try:
        for spec in ("none", "dflash", "ddtree"):
            base, proc = start_server(*tiny_chat_model,
                                      extra=("--spec", spec, "--spec-policy", "fixed"))
            procs.append(proc)
            clients[spec] = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        yield clients
    finally:
        stop_servers(procs)
