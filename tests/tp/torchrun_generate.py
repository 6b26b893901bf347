"""Run by tests/tp/test_torchrun.py under torchrun: every rank builds LLM(tensor_parallel_size=
WORLD_SIZE); ranks > 0 serve rank 0 inside LLM() and exit with it; rank 0 prints the tokens."""

import json
import sys

from flashtree import LLM, SamplingParams

model, drafter = sys.argv[1], sys.argv[2]
llm = LLM(model=model, draft=drafter, spec="ddtree", spec_policy="fixed",
          device="cpu", skip_tokenizer_init=True,
          tensor_parallel_size=2)
outs = llm.generate([[1, 5, 7, 9], [3, 4]],
                    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
print(json.dumps([o.outputs[0].token_ids for o in outs]))
llm.shutdown()
