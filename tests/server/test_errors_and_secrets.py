"""Without a model: an unexpected error is OpenAI's 500 (or a stream's last error event), logged
with its traceback under the request id; the API key's sources; the systemd unit keeps the key
out of the arguments and gives the drain time to finish."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
from pathlib import Path

import httpx
import pytest
from fastapi.responses import StreamingResponse

from flashtree.cli import build_parser
from flashtree.server.app import ServerConfig, ServerState, build_app
from flashtree.server.errors import ApiError
from flashtree.server.guard import read_api_key

UNIT = Path(__file__).parents[2] / "deploy" / "flashtree.service"


def _app_with_faults():
    """The real app with routes that fail the way a bug would (before answering, and in the
    middle of a stream) and the way a failed engine request is reported (ApiError 500)."""
    app = build_app(ServerConfig(model_name="m"), ServerState())

    @app.get("/v1/engine-failed")
    async def engine_failed():
        raise ApiError(500, "request failed: RuntimeError: boom")

    @app.get("/v1/fails")
    async def fails():
        raise RuntimeError("internal detail 1234")

    @app.get("/v1/fails-mid-stream")
    async def fails_mid_stream():
        async def events():
            yield "data: {}\n\n"
            raise RuntimeError("internal detail 5678")
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def _get(app, path: str, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as client:
        return await client.get(path, headers=headers)


def test_unexpected_error_is_an_openai_500_logged_under_the_request_id(caplog):
    app = _app_with_faults()
    with caplog.at_level(logging.ERROR, logger="flashtree.server"):
        r = asyncio.run(_get(app, "/v1/fails", {"x-request-id": "rid-500"}))
        stream = asyncio.run(_get(app, "/v1/fails-mid-stream", {}))
        reported = asyncio.run(_get(app, "/v1/engine-failed", {"x-request-id": "rid-api"}))
    assert r.status_code == 500 and r.headers["x-request-id"] == "rid-500", r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and "rid-500" in error["message"], error
    assert "internal detail" not in r.text and "Traceback" not in r.text
    events = [e.removeprefix("data: ") for e in stream.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events
    rid = stream.headers["x-request-id"]
    assert json.loads(events[-2])["error"]["message"].endswith(rid)
    assert reported.status_code == 500 and reported.headers["x-request-id"] == "rid-api"
    assert reported.json()["error"]["message"] == "request failed: RuntimeError: boom"
    logged = {record.getMessage(): record.exc_info for record in caplog.records}
    assert "request rid-api: 500 request failed: RuntimeError: boom" in logged, logged
    for request_id, detail in (("rid-500", "1234"), (rid, "5678")):
        exc_info = logged[f"request {request_id} failed"]
        assert exc_info is not None and detail in str(exc_info[1]), logged


def test_api_key_sources(tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    key_file.chmod(0o640)  # a group may read it
    assert read_api_key(None, str(key_file), {"FLASHTREE_API_KEY": "env"}) == "from-file"
    assert read_api_key(None, None, {"FLASHTREE_API_KEY": "from-env"}) == "from-env"
    assert read_api_key(None, None, {}) is None
    assert read_api_key("on-the-command-line", None, {}) == "on-the-command-line"
    assert "shows in `ps`" in capsys.readouterr().err
    for mode in (0o644, 0o604, 0o660):  # others may read it, or a group may write it
        key_file.chmod(mode)
        with pytest.raises(ValueError, match=f"mode {mode:o}.*chmod 600"):
            read_api_key(None, str(key_file), {})
    key_file.chmod(0o600)
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(None, str(key_file), {})
    with pytest.raises(ValueError, match="empty"):
        read_api_key(None, None, {"FLASHTREE_API_KEY": ""})
    with pytest.raises(ValueError, match="not both"):
        read_api_key("k", str(key_file), {})


def test_systemd_unit_keeps_the_key_out_of_the_arguments():
    lines = UNIT.read_text().replace("\\\n", " ").splitlines()
    settings = dict(line.split("=", 1) for line in lines if "=" in line and line[0] != "#")
    argv = shlex.split(settings["ExecStart"])
    assert argv[0].endswith("/flashtree") and "$" not in settings["ExecStart"], argv
    args = build_parser().parse_args(argv[1:])
    assert args.api_key is None and settings["EnvironmentFile"], settings  # the key's home
    # systemd kills what is left at TimeoutStopSec: the drain must end well before it.
    assert args.shutdown_timeout + 10 <= int(settings["TimeoutStopSec"]), settings
