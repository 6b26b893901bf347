"""Multi-turn chat with and without prefix caching, in process: conversations that share a long
system prompt, each turn's prompt the whole conversation so far plus a new user message, sent
one request at a time as a chat user sends them. Time to first token (TTFT) and decode
tokens/s per request, caching on against off in the same run, and whether every answer is the
same (greedy; where one is not, the first differing token and how close the uncached run's top
two choices were there). The first request of a run computes the shared prefix either way; the
ratio is over the others.

    python benchmarks/prefix_bench.py --out benchmarks/results/DATE-prefix-cpu.md
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import write_results  # noqa: E402
from flashtree import LLM, SamplingParams  # noqa: E402
from flashtree.logprobs import Logprob  # noqa: E402


def chat(llm: LLM, args: argparse.Namespace) -> list[dict]:
    """Every conversation's turns in order, one request at a time -> per request: TTFT,
    decode tokens/s, the answer, and the prompt tokens the cache held."""
    rng = random.Random(args.seed)
    vocab = llm.model_config.vocab_size
    system = [rng.randrange(200, vocab) for _ in range(args.prefix_tokens)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for conv in range(args.conversations):
        prompt = list(system)
        for turn in range(args.turns):
            prompt += [rng.randrange(200, vocab) for _ in range(args.user_tokens)]
            start = time.perf_counter()
            seq = llm.engine.add_request(prompt, params)
            while not seq.output_ids:
                llm.engine.step()
            first = time.perf_counter()
            while not seq.is_finished:
                llm.engine.step()
            end = time.perf_counter()
            rows.append({"conversation": conv, "turn": turn, "prompt": list(prompt),
                         "prompt_tokens": len(prompt),
                         "cached_tokens": seq.num_cached_tokens, "ttft_s": first - start,
                         "decode_tokens_per_s": (len(seq.output_ids) - 1) / (end - first),
                         "tokens": list(seq.output_ids)})
            prompt += seq.output_ids
    return rows


def first_divergences(args: argparse.Namespace, runs: dict[str, list[dict]]) -> list[dict]:
    """Per conversation, the first answer token where caching on and off differ (later turns
    then see different prompts), with the uncached run's top-2 log-prob gap there, scored
    again by a plain engine: a gap near zero is a near-tie that rounding may flip."""
    found = []
    for off, on in zip(runs["off"], runs["on"]):
        if any(d["conversation"] == off["conversation"] for d in found):
            continue
        at = next((i for i, (a, b) in enumerate(zip(off["tokens"], on["tokens"])) if a != b),
                  None)
        if at is not None:
            found.append({"conversation": off["conversation"], "turn": off["turn"], "token": at,
                          "sequence": off["prompt"] + off["tokens"][: at + 1]})
    if not found:
        return []
    llm = LLM(model=args.model, spec="none", device=args.device, dtype=args.dtype,
              max_model_len=max(len(d["sequence"]) for d in found) + 8, max_num_seqs=1,
              skip_tokenizer_init=True, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    for d in found:
        scored = llm.generate([d.pop("sequence")], params)[0].prompt_logprobs[-1]
        top: list[Logprob] = sorted(scored.values(), key=lambda lp: lp.rank)
        d["top2_gap"] = top[0].logprob - top[1].logprob
    llm.shutdown()
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--spec", default=None, help="none, dflash or ddtree (default: LLM's)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="markdown report (JSON beside it)")
    args = ap.parse_args()
    longest = args.prefix_tokens + args.turns * (args.user_tokens + args.max_tokens) + 64
    runs = {}
    for caching in (False, True):
        llm = LLM(model=args.model, spec=args.spec, device=args.device, dtype=args.dtype,
                  max_model_len=longest, max_num_seqs=1, skip_tokenizer_init=True,
                  enable_prefix_caching=caching)
        runs["on" if caching else "off"] = chat(llm, args)
        llm.shutdown()
        del llm
    off, on = runs["off"][1:], runs["on"][1:]
    res = {"machine": (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                       else platform.processor() or "CPU") + f", torch {torch.__version__}",
           "command": "python benchmarks/prefix_bench.py " + " ".join(sys.argv[1:]),
           "runs": runs,
           "ttft_off_over_on": statistics.mean(r["ttft_s"] for r in off)
           / statistics.mean(r["ttft_s"] for r in on),
           "decode_on_over_off": statistics.mean(r["decode_tokens_per_s"] for r in on)
           / statistics.mean(r["decode_tokens_per_s"] for r in off),
           "same_answers": [r["tokens"] for r in runs["on"]] == [r["tokens"] for r in
                                                                  runs["off"]]}
    res["divergences"] = first_divergences(args, runs)
    lines = ["# Prefix caching in a multi-turn chat", "",
             f"Machine: {res['machine']}. Command: `{res['command']}`. A shared "
             f"{args.prefix_tokens}-token system prompt, {args.conversations} conversations of "
             f"{args.turns} turns ({args.user_tokens} new user tokens, {args.max_tokens} "
             "answer tokens each), one request at a time, greedy.", "",
             "| conversation | turn | prompt tokens | cached | TTFT off s | TTFT on s | "
             "decode tok/s off | on |", "|---|---|---|---|---|---|---|---|"]
    for a, b in zip(runs["off"], runs["on"]):
        lines.append(f"| {a['conversation']} | {a['turn']} | {a['prompt_tokens']} | "
                     f"{b['cached_tokens']} | {a['ttft_s']:.3f} | {b['ttft_s']:.3f} | "
                     f"{a['decode_tokens_per_s']:.1f} | {b['decode_tokens_per_s']:.1f} |")
    lines += ["", f"TTFT without caching over with it (all but the first request): "
              f"**{res['ttft_off_over_on']:.1f}x** (goal >= 5). Decode tokens/s with over "
              f"without: {res['decode_on_over_off']:.2f}. Same answers: {res['same_answers']}.",
              ""]
    lines += [f"Conversation {d['conversation']} first differs at turn {d['turn']}, answer "
              f"token {d['token']}, where the uncached run's top two log-probs were "
              f"{d['top2_gap']:.3f} apart." for d in res["divergences"]]
    for r in runs.values():
        for row in r:
            row.pop("tokens"), row.pop("prompt")
    write_results(args.out, "\n".join(lines), res)


if __name__ == "__main__":
    main()
