"""Every supported family starts on CUDA as a user starts it: by default replaying CUDA graphs
(Qwen3-MoE's and DeepSeek-V3's grouped-GEMM experts, DeepSeek-V3's MLA through the Triton latent
attention), and with `enforce_eager=True`. Greedy tokens, plain and DDTree over a random
drafter, equal transformers' on the same device. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.helpers import save_checkpoint
from tests.tiny import (
    save_reference_drafter,
    save_tiny_deepseek_v3,
    save_tiny_qwen3_moe,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# family -> checkpoint writer
FAMILIES = {
    "llama": lambda p: save_checkpoint(p, "llama", seed=1),
    "qwen2": lambda p: save_checkpoint(p, "qwen2", seed=2),
    "qwen3": lambda p: save_checkpoint(p, "qwen3", seed=3, head_dim=12),
    "qwen3_moe": lambda p: save_tiny_qwen3_moe(p, seed=4),
    "deepseek_v3": lambda p: save_tiny_deepseek_v3(p, seed=5),
}
PROMPTS = [[3, 17, 40, 8, 22, 5, 61, 9, 30], [12, 4, 7], [50, 2, 33, 19, 11]]
NEW_TOKENS = 12


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_starts_on_cuda_and_decodes_like_transformers(family, tmp_path):
    import transformers

    target = FAMILIES[family](tmp_path / "target")
    drafter = save_reference_drafter(tmp_path / "drafter", target, block_size=4,
                                     target_layer_ids=[0, 1])
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    want = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for spec in ("none", "ddtree"):
        for eager in (False, True):
            extra = {} if spec == "none" else {"draft": str(drafter), "spec": spec}
            llm = LLM(model=str(target), device="cuda", dtype="float32",
                      skip_tokenizer_init=True, page_size=4, max_num_seqs=4,
                      enforce_eager=eager, **extra)
            assert (llm.engine.runner.graphs is not None) == (not eager)
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            assert got == want, f"{family} spec={spec} enforce_eager={eager}"
