"""Health before and after loading, and SIGTERM: running requests finish, then the server
exits cleanly."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.server.conftest import API_KEY, MODEL, start_server


def test_health_is_503_until_loaded_then_sigterm_drains_and_exits(tiny_chat_model):
    statuses: list[int] = []
    base, proc = start_server(*tiny_chat_model, statuses=statuses)
    assert statuses[0] == 503 and statuses[-1] == 200, statuses
    chunks: list[str] = []
    first = threading.Event()

    def consume():
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 60, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append("".join(c["text"] for c in json.loads(line[6:])["choices"]))
                    first.set()
                elif line == "data: [DONE]":
                    chunks.append("[DONE]")

    reader = threading.Thread(target=consume)
    reader.start()
    assert first.wait(60)
    proc.terminate()  # SIGTERM
    reader.join(120)
    assert chunks[-1] == "[DONE]", "the running stream was cut off"
    assert proc.wait(timeout=90) == 0  # drained, engine shut down, a clean exit
    started = time.time()
    while time.time() - started < 5:
        try:
            httpx.get(f"{base}/health", timeout=1)
        except httpx.HTTPError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("server still answers after SIGTERM")
