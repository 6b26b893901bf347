"""The profiler's read-to-launch window (`host_window.read_to_launch`): from each device step's
read to the next forward, on a real engine on the CPU."""

from __future__ import annotations

import cProfile
import pstats

import torch

from flashtree import LLM, SamplingParams
from flashtree.bench.host_window import read_to_launch


def test_the_window_holds_the_bookkeeping_between_a_read_and_the_next_forward(small_pair):
    target, drafter = map(str, small_pair)
    llm = LLM(model=target, draft=drafter, spec="ddtree", spec_policy="fixed", device="cpu",
              skip_tokenizer_init=True, max_num_seqs=2)
    eng = llm.engine
    for prompt in ([0, 1, 2], [3, 4]):
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    eng.step()  # the prompts: no device read
    reads = []
    real_verify = eng.speculative.device_verifier.verify
    eng.speculative.device_verifier.verify = lambda *a: reads.append(1) or real_verify(*a)
    prof = cProfile.Profile()
    with read_to_launch(prof, torch.device("cpu")) as windows:
        for _ in range(4):
            eng.step()
    # Each step's read opens a window that the next step's verify closes; the last stays open.
    assert len(reads) == 4 and len(windows) == 3 and all(w > 0 for w in windows)
    stats = pstats.Stats(prof).stats  # (file, line, function) -> timings
    held = {name for _, _, name in stats}
    # The host's work after a read, up to the next forward's inputs.
    assert {"schedule", "_commit", "build"} <= held
    # No model code ran inside a window (the forward itself is past its end).
    assert not [f for f, _, _ in stats if "flashtree/models/" in f or "flashtree/layers/" in f]
