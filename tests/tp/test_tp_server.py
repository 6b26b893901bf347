"""`flashtree serve --tp 2`: a real server whose model is split over two gloo ranks answers the
openai client like the single-process one, and when its worker is killed it fails the request,
says which rank died, and exits with status 1 instead of hanging."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY, MODEL, start_server


def _spawned_children(pid: int) -> list[int]:
    """Worker processes started by multiprocessing's spawn (not its resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_tp2_server_serves_then_reports_a_dead_worker(tiny_chat_model):
    from openai import OpenAI

    base, proc = start_server(*tiny_chat_model, extra=("--tp", "2"))
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        messages = [{"role": "user", "content": "Hello there"}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                               temperature=0)
        assert reply.usage.completion_tokens > 0
        workers = _spawned_children(proc.pid)
        assert len(workers) == 1
        subprocess.run(["kill", "-9", str(workers[0])], check=True)
        with pytest.raises(Exception):  # noqa: B017 - the stream ends with an error or a 5xx
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert f"tensor-parallel worker rank 1 (pid {workers[0]}) died" in out
