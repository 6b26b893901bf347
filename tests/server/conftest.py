"""A real `flashtree serve` process on loopback, serving a tiny random Llama that carries the
default model's real tokenizer and chat template (fast on CPU, real text handling); helpers the
server tests share."""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from flashtree.bench.server_process import launch, stop_servers

API_KEY = "test-key"
MODEL = "tiny"  # --served-model-name
# The logs of servers started with `start_server`, removed when the session ends.
_LOGS = tempfile.TemporaryDirectory(prefix="flashtree-servers-")
_LOG_NUMBERS = itertools.count()


def serve(model: Path | str, log: Path, *flags: str, env: dict[str, str] | None = None,
          statuses: list[int] | None = None) -> tuple[str, subprocess.Popen]:
    """(base url, process) of `flashtree serve MODEL FLAGS` as `MODEL`, once /health answers
    200 (`flashtree.bench.server_process.launch`). The API key comes from `env` or `flags`,
    never from the test's own environment."""
    env = {k: v for k, v in os.environ.items() if k != "FLASHTREE_API_KEY"} | (env or {})
    return launch(str(model), log, "--served-model-name", MODEL, *flags, env=env,
                  statuses=statuses)


def start_server(model, drafter, statuses: list[int] | None = None, extra: tuple = (),
                 log: Path | None = None) -> tuple[str, subprocess.Popen]:
    """Start `flashtree serve` the way users do, with the test suite's limits, and wait until
    /health answers 200 (every /health status seen on the way is appended to `statuses`). Its
    output goes to `log` (by default a file of its own, removed at the session's end)."""
    log = log or Path(_LOGS.name) / f"server-{next(_LOG_NUMBERS)}.log"
    return serve(model, log, "--draft", str(drafter), "--api-key", API_KEY, "--device", "cpu",
                 "--max-model-len", "256", "--max-tokens-limit", "200",
                 "--max-request-bytes", "20000", "--max-num-seqs", "64", *extra,
                 statuses=statuses)


def metric(base: str, name: str) -> float:
    """The server's /metrics value of `name` (a series name, or one with its labels), summed
    over its labelled series."""
    text = httpx.get(f"{base}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def openai_error(response: httpx.Response, status: int) -> dict:
    """The response's error object, checked to be OpenAI's: a JSON body holding only `error`,
    with exactly OpenAI's four keys, typed as a client's error."""
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"] == "application/json", response.headers
    body = response.json()
    assert list(body) == ["error"], body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]


@pytest.fixture(scope="session")
def served_tokenizer(tiny_chat_model):
    """transformers' own tokenizer of the served model: the oracle for prompt lengths."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_chat_model[0]))


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
