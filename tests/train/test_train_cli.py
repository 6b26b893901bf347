"""`flashtree train-drafter` end to end on the embedded default model: self-instruct prompts,
mixed greedy/sampled responses saved to --data and reused by a second run, whose steps lower the
held-out loss and whose saved drafter gives, in z-lab's reference package, flashtree's logits."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from flashtree.train.drafter import load_examples
from flashtree.train.prompts import first_line_prompt
from tests.train.trained_drafter_checks import (
    assert_reference_gives_our_block_logits,
    held_out_losses,
)


def _train(*args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "flashtree", "train-drafter", "--target",
                          "default", "--steps", "2", "--batch-size", "2", "--anchors", "4",
                          "--layers", "1", *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout + run.stderr


def test_cli_generates_saves_and_reuses_distillation_data(tmp_path, default_llm,
                                                          hf_gguf_model):
    data = tmp_path / "data.npz"
    log = _train("--out", str(tmp_path / "a"), "--num-prompts", "6", "--self-instruct", "6",
                 "--sampled-fraction", "0.5", "--max-new-tokens", "12", "--data", str(data))
    assert "the target wrote" in log and "generated" in log
    examples = load_examples(data)
    assert 6 <= len(examples) <= 12  # built-in prompts plus the usable self-written ones
    for ex in examples:
        assert 2 <= len(ex.tokens) - ex.response_start <= 12
        assert max(ex.tokens) < default_llm.model_config.vocab_size
    log = _train("--out", str(tmp_path / "b"), "--data", str(data), "--log-every", "1")
    assert f"loaded {len(examples)} examples" in log and "generated" not in log
    # A tenth of the examples is held out: the two steps lower its loss below the initial
    # drafter's.
    losses = held_out_losses(log)
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert_reference_gives_our_block_logits(tmp_path / "b", hf_gguf_model,
                                            examples[0].tokens[:24])


@pytest.mark.parametrize("flag, value, message", [
    ("--sampled-fraction", "1.5", "--sampled-fraction must be in [0, 1], got 1.5"),
    ("--val-examples", "-1", "--val-examples must be >= 0, got -1"),
])
def test_bad_options_are_refused_before_loading(flag, value, message):
    run = subprocess.run([sys.executable, "-m", "flashtree", "train-drafter", "--out", "unused",
                          flag, value], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert message in run.stderr
    assert "loading" not in run.stderr.lower()


def test_saved_data_keeps_every_token(tmp_path):
    from flashtree.train.drafter import Example, save_examples

    rng = np.random.default_rng(0)
    examples = [Example(rng.integers(0, 50000, n).tolist(), int(s)) for n, s in [(5, 2), (9, 3)]]
    save_examples(tmp_path / "d.npz", examples)
    assert load_examples(tmp_path / "d.npz") == examples


def test_first_line_prompt_strips_markers_and_rejects_fragments():
    assert first_line_prompt("\n1. How do owls see at night?\nmore") == "How do owls see at night?"
    assert first_line_prompt('Question: "What is 25 plus 7?"') == "What is 25 plus 7?"
    assert first_line_prompt("25 students went on a trip.") == "25 students went on a trip."
    assert first_line_prompt("Sure!\nWrite a poem") is None
