"""SIGTERM with a stream that outlives `--shutdown-timeout`: the stream ends with an error event
and [DONE], the process exits 0 and logs no traceback. The key comes from the environment."""

from __future__ import annotations

import json
import subprocess
import time

import httpx

from tests.server.conftest import MODEL, serve
from tests.server.launch import LONG_RUN, cmdline, long_context

KEY = "env-key-0123456789"
TIMEOUT = 1  # --shutdown-timeout, seconds
MAX_TOKENS = 8000  # many times what the tiny model decodes on a CPU within TIMEOUT


def _stream_cut_by_sigterm(base: str, proc: subprocess.Popen) -> tuple[list[dict], float]:
    """The events of a long stream during which the server gets SIGTERM (once it runs), all
    but [DONE], which must end it; and the seconds from SIGTERM to the stream's end."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    proc.terminate()  # SIGTERM once the stream runs
                    signalled = time.monotonic()
    assert events[-1:] == ["[DONE]"], events[-3:]
    return [json.loads(e) for e in events[:-1]], time.monotonic() - signalled


def test_drain_timeout_ends_streams_with_an_error_event(tiny_chat_model, tmp_path):
    log = tmp_path / "server.log"
    model = long_context(tiny_chat_model[0], tmp_path / "model")
    base, proc = serve(model, log, *LONG_RUN, "--shutdown-timeout", str(TIMEOUT),
                       env={"FLASHTREE_API_KEY": KEY})
    try:
        assert not any(KEY in a for a in cmdline(proc)), cmdline(proc)
        assert httpx.get(f"{base}/v1/models").status_code == 401
        events, cut_after = _stream_cut_by_sigterm(base, proc)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    *tokens, last = events
    # Still running when cut: no choice had finished, and the drain waited its timeout.
    assert not any(c["finish_reason"] for e in tokens for c in e["choices"]), tokens[-1]
    assert cut_after >= TIMEOUT, cut_after
    assert "error" in last, f"the stream ended before the drain timeout cut it: {last}"
    assert (last["error"]["type"], last["error"]["code"]) == ("server_error", "shutdown"), last
    text = log.read_text()
    for bad in ("Traceback", "CancelledError", "Event loop is closed", "Exception in"):
        assert bad not in text, text
