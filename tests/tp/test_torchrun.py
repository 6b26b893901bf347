"""torchrun launches tensor parallelism too: two ranks started by torch.distributed.run, rank 0
drives, and its tokens equal the single-process ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flashtree import LLM, SamplingParams
from tests.tp.test_tp_cpu import tiny  # noqa: F401 - the module's tiny target and drafter


def test_torchrun_two_ranks_equal_one_process(tiny):  # noqa: F811
    target, drafter = tiny
    script = Path(__file__).with_name("torchrun_generate.py")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(script), str(target),
         str(drafter)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    one = LLM(model=str(target), draft=str(drafter), spec_policy="fixed",
              spec="ddtree", device="cpu",
              skip_tokenizer_init=True)
    want = one.generate([[1, 5, 7, 9], [3, 4]],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert got == [o.outputs[0].token_ids for o in want]
