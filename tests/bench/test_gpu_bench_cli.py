"""benchmarks/gpu_bench.py end to end on CPU (`--shape tiny --device cpu`): every section runs,
the report has its tables and the JSON its five headline ratios. A check of the script, not of
speed: the numbers are CPU numbers of tiny random models."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADLINE = ("ar_step_over_floor", "verify64_over_ar_step", "draft_over_ar_step",
            "speedup_vs_reference_dflash", "ddtree_over_dflash_e2e")


def test_tiny_cpu_run_writes_report_and_json(tmp_path, tiny_chat_model):
    # The default pair is a tiny Llama with the default model's tokenizer (chat template) and a
    # random reference-format drafter (tests/conftest.py), so that section runs in seconds.
    target, drafter = tiny_chat_model
    out = tmp_path / "x.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--shape", "tiny",
           "--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(out),
           "--default-model", str(target), "--default-draft", str(drafter),
           "--pair-prompts", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    data = json.loads(out.with_suffix(".json").read_text())
    assert data["errors"] == {}, data["errors"]
    for key in HEADLINE:
        value = data[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    assert data["results"]["default_pair"]["prompts"].endswith("chat template")

    md = out.read_text()
    for table in ("## Goals", "| goal | value | target | met |",
                  "| batch | ctx | step ms | floor ms | step / floor |",
                  "| nodes | ctx 256 ms | / AR step | ctx 1024 ms | / AR step |",
                  "| engine | tokens/s | total s | decode ms/token |",
                  "| engine | tokens/s | mean acceptance | vs reference chain |",
                  "Device-to-device copy", "proposer.draft_logits"):
        assert table in md, table
    assert "Failed:" not in md
    assert md.count("| 512 |") == 1  # every tree size up to 512 nodes


def test_sections_subset_and_time_limit(tmp_path):
    # --sections picks a subset; --time-limit 0 skips every section yet still writes both
    # files, recording the skips instead of failing.
    out = tmp_path / "y.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--shape", "tiny",
           "--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(out),
           "--sections", "bandwidth", "verify", "--time-limit", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["sections"] == ["bandwidth", "verify"]
    assert set(data["errors"]) == {"bandwidth", "verify"}
    assert all(data[k] is None for k in HEADLINE)
    assert "NOT met" in out.read_text()
