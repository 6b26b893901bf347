"""Where a decode step's time goes: the engine generating for many requests at once on a
SmolLM2-135M-shaped random target, profiled with torch.profiler (CPU and CUDA time per op).

    python benchmarks/profile_step.py --batch 1024 --sampled-fraction 0.5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashtree import LLM, SamplingParams  # noqa: E402

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=8192, rope_theta=1e5, tie_word_embeddings=True,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--sampled-fraction", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--sdpa-backends", default=None,
                    help="comma list of torch SDPBackend names to allow, e.g. "
                         "EFFICIENT_ATTENTION,MATH (default: torch's choice)")
    args = ap.parse_args()
    if args.sdpa_backends:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        allowed = [getattr(SDPBackend, name) for name in args.sdpa_backends.split(",")]
        sdpa_kernel(allowed).__enter__()  # for the whole run

    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(d)
        llm = LLM(model=d, device=args.device, dtype=args.dtype, skip_tokenizer_init=True,
                  max_num_seqs=args.batch, max_model_len=1024)
    eng = llm.engine
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        temp = 1.0 if i < args.sampled_fraction * args.batch else 0.0
        prompt = torch.randint(0, 49152, (args.prompt_len,), generator=gen).tolist()
        eng.add_request(prompt, SamplingParams(temperature=temp, max_tokens=500, seed=i,
                                               ignore_eos=True))
    while any(s.num_uncomputed > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(5):
        eng.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    sync()
    per_step = (time.perf_counter() - t) / args.steps
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            eng.step()
        sync()
    print(f"batch {args.batch}: {per_step * 1e3:.1f} ms per decode step, "
          f"{args.batch / per_step:.0f} tokens/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if torch.cuda.is_available():
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
