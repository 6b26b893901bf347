"""Servers for the hostile-client and shutdown tests: a tiny checkpoint whose context is long
enough that one request keeps it busy for seconds, and the arguments `ps` shows for a server
(whose API key must not be among them)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

# With `long_context` models: a request of 8000 tokens keeps the tiny model busy for seconds,
# long enough to cancel it or cut it at shutdown.
LONG_RUN = ("--spec", "none", "--device", "cpu", "--max-model-len", "8192",
            "--max-tokens-limit", "8000", "--max-num-seqs", "2")


def long_context(model: Path, dest: Path) -> Path:
    """A copy of a tiny checkpoint whose context is 8192 tokens (rotary positions are computed,
    so the weights serve any length)."""
    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    return dest


def cmdline(proc: subprocess.Popen) -> list[str]:
    """The arguments `ps` shows for the process."""
    return Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")
