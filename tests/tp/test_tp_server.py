"""`flashtree serve --tp 2`: a real server whose model is split over two gloo ranks answers the
openai client with plain decoding's greedy tokens (computed here by `LLM` in one process), and
when its worker is killed it fails the request with a 500 whose request id the log ties to the
dead rank, and exits with status 1 instead of hanging."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY, MODEL, start_server

MESSAGES = [{"role": "user", "content": "Hello there"}]


def _spawned_children(pid: int) -> list[int]:
    """Worker processes started by multiprocessing's spawn (not its resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _plain_reply(model: Path):
    """Single-process plain decoding of the same chat (the server speculates with DDTree,
    which at temperature 0 returns exactly plain decoding's tokens, and TP=2 returns TP=1's)."""
    from flashtree import LLM, SamplingParams

    llm = LLM(model=str(model), spec="none", device="cpu", max_model_len=256)
    return llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8))[0]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_tp2_server_serves_then_reports_a_dead_worker(tiny_chat_model, tmp_path):
    import openai

    want = _plain_reply(tiny_chat_model[0])
    log = tmp_path / "server.log"
    base, proc = start_server(*tiny_chat_model, extra=("--tp", "2"), log=log)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                               temperature=0)
        assert reply.choices[0].message.content == want.outputs[0].text
        assert reply.choices[0].finish_reason == want.outputs[0].finish_reason
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
            len(want.prompt_token_ids), len(want.outputs[0].token_ids))
        workers = _spawned_children(proc.pid)
        assert len(workers) == 1
        subprocess.run(["kill", "-9", str(workers[0])], check=True)
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    died = f"tensor-parallel worker rank 1 (pid {workers[0]}) died"
    request_id = failed.value.response.headers["x-request-id"]
    assert failed.value.status_code == 500 and request_id in failed.value.body["message"]
    assert proc.returncode == 1
    out = log.read_text()
    assert f"request {request_id} failed in the engine" in out and died in out
