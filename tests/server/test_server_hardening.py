"""The server in-process over a scripted engine (the served model's real tokenizer, deltas
chosen by the test): the app served from several event loops, how streams end when the
server cuts them or the engine fails (the Responses API's own ending on /v1/responses), 500s
that name the request id and never the failure's detail, `param` naming the field at fault,
the early length check of conversations, and the logging that `serve` sets up."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.responses import StreamingResponse
from openai import AsyncOpenAI

from flashtree.cli import build_parser, configure_server_logging
from flashtree.engine.async_engine import STOP_TIMEOUT, Delta
from flashtree.server.app import UVICORN_GRACE, ServerConfig, ServerState, build_app
from flashtree.server.protocol import CompletionRequest
from tests.server.conftest import openai_error

CONTEXT = 256
UNIT = Path(__file__).parents[2] / "deploy" / "flashtree.service"


class ScriptedEngine:
    """What the routes use of AsyncEngine: each request streams `script`'s deltas; an
    exception in it is raised, and "hang" calls `on_hang` (if set), then waits until the
    request is cancelled."""

    def __init__(self, script: list) -> None:
        self.script, self.on_hang = script, None

    async def generate(self, prompt_ids, params):
        for item in self.script:
            if item == "hang":
                if self.on_hang is not None:
                    self.on_hang()
                await asyncio.Event().wait()
            if isinstance(item, Exception):
                raise item
            yield item


@pytest.fixture(scope="module")
def tokenizer():
    from flashtree.models.registry import default_model_path
    from flashtree.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path())


def _app(tokenizer, script: list):
    """(the app, its state) serving a model of CONTEXT tokens through a scripted engine."""
    state = ServerState()
    engine = SimpleNamespace(args=SimpleNamespace(scheduler=SimpleNamespace(
        max_model_len=CONTEXT)), model_cfg=SimpleNamespace(vocab_size=len(tokenizer.hf)))
    state.llm = SimpleNamespace(tokenizer=tokenizer, engine=engine)
    state.engine = ScriptedEngine(script)
    return build_app(ServerConfig(model_name="m"), state), state


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _openai(app) -> AsyncOpenAI:
    return AsyncOpenAI(base_url="http://test/v1", api_key="k", max_retries=0,
                       http_client=_client(app))


HELLO = Delta("Hel", [1])
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def test_the_same_app_answers_slow_streams_on_two_event_loops():
    """The drain's deadline binds to no event loop: a stream served on a second loop (uvicorn
    restarted in-process, or two test clients) runs to its end."""
    app = build_app(ServerConfig(model_name="m"), ServerState())

    @app.get("/v1/slow")
    async def slow():
        async def events():
            for i in range(3):
                await asyncio.sleep(0.05)
                yield f"data: {i}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def fetch() -> str:
        async with _client(app) as client:
            return (await client.get("/v1/slow")).text

    for _ in range(2):
        assert asyncio.run(fetch()) == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def _responses_events(app) -> list:
    """The `openai` client's events of a streamed response."""
    async with _openai(app) as client:
        stream = await client.responses.create(model="m", input="Hi", stream=True,
                                               extra_headers={"x-request-id": "rid-r"})
        return [event async for event in stream]


@pytest.mark.parametrize("script, words", [
    ([HELLO, "hang"], "shutting down"),  # cut by the drain
    ([HELLO, Delta("", [], True, "error", error="detail 42")], "rid-r"),  # the engine failed it
    ([HELLO, RuntimeError("detail 43")], "rid-r"),  # a bug raised mid-stream
], ids=["shutdown", "engine-error", "exception"])
def test_a_cut_responses_stream_ends_with_response_failed(tokenizer, script, words, caplog):
    app, state = _app(tokenizer, script)
    state.engine.on_hang = state.drain.expire  # the drain runs out once the stream runs
    with caplog.at_level(logging.ERROR, logger="flashtree"):
        events = asyncio.run(_responses_events(app))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-2].type == "response.output_text.delta" and events[-2].delta == "Hel"
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed", last
    assert last.response.error.code == "server_error", last.response.error
    assert words in last.response.error.message and "detail" not in last.response.error.message
    assert last.response.output[0].content[0].text == "Hel"
    if "rid-r" in words:  # the detail is in the log, under the request id
        assert "rid-r" in caplog.text and "detail 4" in caplog.text, caplog.text


def test_responses_stream_has_no_done_marker(tokenizer):
    app, state = _app(tokenizer, [HELLO, "hang"])
    state.engine.on_hang = state.drain.expire

    async def raw() -> str:
        async with _client(app) as client:
            r = await client.post("/v1/responses", json={"model": "m", "input": "Hi",
                                                         "stream": True})
            return r.text

    text = asyncio.run(raw())
    assert "[DONE]" not in text and text.rstrip().splitlines()[0] == "event: response.created"
    assert text.split("\n\n")[-2].startswith("event: response.failed"), text


def _post(app, path: str, body: dict, rid: str = "rid-1") -> httpx.Response:
    async def post():
        async with _client(app) as client:
            return await client.post(path, json=body, headers={"x-request-id": rid})
    return asyncio.run(post())


def test_engine_failures_name_the_request_id_not_the_detail(tokenizer, caplog):
    failed = Delta("", [], True, "error", error="RuntimeError: secret detail")
    app, _ = _app(tokenizer, [HELLO, failed])
    with caplog.at_level(logging.ERROR, logger="flashtree"):
        whole = _post(app, "/v1/chat/completions", CHAT, "rid-whole")
        stream = _post(app, "/v1/chat/completions", {**CHAT, "stream": True}, "rid-stream")
        response = _post(app, "/v1/responses", {"model": "m", "input": "Hi"}, "rid-resp")
    for r, rid in ((whole, "rid-whole"), (response, "rid-resp")):
        assert r.status_code == 500, r.text
        assert r.json()["error"] == {
            "message": f"internal server error; the server logged it under request id {rid}",
            "type": "server_error", "param": None, "code": "internal_error"}
    events = [e.removeprefix("data: ") for e in stream.text.split("\n\n") if e]
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert sorted(error) == ["code", "message", "param", "type"], error
    assert error["message"].endswith("rid-stream") and error["type"] == "server_error"
    assert "secret" not in whole.text + stream.text + response.text
    for rid in ("rid-whole", "rid-stream", "rid-resp"):
        assert f"request {rid} failed in the engine: RuntimeError: secret detail" \
            in caplog.text, caplog.text


def test_a_conversation_too_long_by_its_length_alone_is_refused_before_rendering(
        tokenizer, monkeypatch):
    app, _ = _app(tokenizer, [HELLO])

    def render(*args, **kwargs):
        raise AssertionError("rendered a conversation its length proves too long")

    monkeypatch.setattr(tokenizer, "apply_chat_template", render)
    huge = "word " * 20000  # 100 kB: its length alone proves it over the context
    chat = openai_error(_post(app, "/v1/chat/completions",
                              {**CHAT, "messages": [{"role": "user", "content": huge}]}), 400)
    response = openai_error(_post(app, "/v1/responses", {"model": "m", "input": huge}), 400)
    for error, param in ((chat, "messages"), (response, "input")):
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
        assert re.search(rf"at least \d+ tokens; .*context \(max_model_len\) is {CONTEXT}",
                         error["message"]), error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", CHAT, "messages"),
    ("/v1/responses", {"model": "m", "input": "Hi"}, "input"),
])
def test_a_template_that_fails_names_the_conversation_field(tokenizer, monkeypatch, path,
                                                            body, param):
    app, _ = _app(tokenizer, [HELLO])

    def render(*args, **kwargs):
        raise ValueError("the template refuses this")

    monkeypatch.setattr(tokenizer, "apply_chat_template", render)
    error = openai_error(_post(app, path, body), 400)
    assert error["param"] == param and "refuses this" in error["message"], error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 4}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 4}, "max_completion_tokens"),
    ("/v1/responses", {"model": "m", "input": "Hi"}, "max_output_tokens"),
])
def test_a_request_the_kv_cache_cannot_hold_names_its_token_limit(tokenizer, path, body,
                                                                  param):
    refusal = ValueError("request needs 9000 tokens of KV cache (prompt, max_tokens and 0 "
                         "speculative) but the pool holds only 64; lower max_tokens")
    app, _ = _app(tokenizer, [refusal])
    assert openai_error(_post(app, path, body), 400)["param"] == param


def test_stop_token_ids_outside_the_vocabulary_name_the_entry(tokenizer):
    """As the request's validation names a negative id (`stop_token_ids.0`)."""
    app, _ = _app(tokenizer, [HELLO])
    body = {"model": "m", "prompt": "Hi", "stop_token_ids": [3, 10**9, 10**9 + 1]}
    error = openai_error(_post(app, "/v1/completions", body), 400)
    assert error["param"] == "stop_token_ids.1" and "1000000000" in error["message"], error
    negative = openai_error(_post(app, "/v1/completions", {**body, "stop_token_ids": [-1]}), 400)
    assert negative["param"] == "stop_token_ids.0", negative


def test_an_unknown_field_is_logged_once_per_name(caplog):
    with caplog.at_level(logging.WARNING, logger="flashtree.server.protocol"):
        for _ in range(3):
            CompletionRequest.model_validate({"model": "m", "prompt": "x",
                                              "field_logged_once": 1})
    assert caplog.text.count("'field_logged_once'") == 1, caplog.text


def test_serve_logs_flashtree_lines_with_time_level_and_logger(capsys):
    logger = logging.getLogger("flashtree")
    before = (list(logger.handlers), logger.level, logger.propagate)
    try:
        configure_server_logging()
        logging.getLogger("flashtree.server").info("a line")
        logging.getLogger("uvicorn.error").warning("not ours")
    finally:
        logger.handlers[:], logger.level, logger.propagate = before
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO flashtree\.server: a line", lines[0]), lines


def test_the_unit_gives_the_whole_stop_time_and_may_lack_its_env_file():
    lines = UNIT.read_text().replace("\\\n", " ").splitlines()
    settings = dict(line.split("=", 1) for line in lines if "=" in line and line[0] != "#")
    assert settings["EnvironmentFile"] == "-/etc/flashtree/env", settings
    args = build_parser().parse_args(shlex.split(settings["ExecStart"])[1:])
    stop = args.shutdown_timeout + UVICORN_GRACE + STOP_TIMEOUT
    assert stop <= int(settings["TimeoutStopSec"]), settings
    assert f"= {stop:.0f} s" in UNIT.read_text()  # the unit's comment gives the sum


def test_requests_an_engine_step_fails_count_as_errors(tiny_chat_model, monkeypatch):
    from flashtree import LLM, SamplingParams
    from flashtree.engine.async_engine import AsyncEngine
    from flashtree.server.metrics import ServerMetrics

    llm = LLM(model=str(tiny_chat_model[0]), device="cpu", max_model_len=CONTEXT, spec="none")

    def step():
        raise RuntimeError("the step broke")

    monkeypatch.setattr(llm.engine, "step", step)
    metrics = ServerMetrics()
    engine = AsyncEngine(llm.engine, on_finish=metrics.observe_finished)

    async def run() -> list[Delta]:
        return [d async for d in engine.generate([1, 2, 3], SamplingParams(max_tokens=4))]

    try:
        deltas = asyncio.run(run())
    finally:
        engine.shutdown()
    assert deltas[-1].finished and deltas[-1].error == "RuntimeError: the step broke", deltas
    count = metrics.registry.get_sample_value("flashtree:request_success_total",
                                              {"finished_reason": "error"})
    assert count == 1
    assert llm.engine.pages.num_free == llm.engine.pages.num_pages  # its KV freed
