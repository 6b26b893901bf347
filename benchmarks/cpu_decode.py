"""CPU decode throughput: flashtree vs Hugging Face transformers `generate`, same model, same run.

Plain autoregressive greedy decoding of the embedded default model (SmolLM2-135M-Instruct, the
Q4_1 GGUF dequantized to float32 by both engines) at batch 1 and batch 8. Both engines get the
same token ids (8 chat prompts rendered with the chat template) and generate exactly
`--max-new-tokens` tokens per prompt (flashtree: `ignore_eos=True`; transformers:
`min_new_tokens=max_new_tokens`).

Throughput = generated tokens / wall time of the whole generate call, so it INCLUDES prefill
(and, for flashtree, detokenization of the final text). Batch 1 runs the 8 prompts one after the
other, one generate call each, and divides all their tokens by the summed wall time; batch 8 is
one generate call over all 8 prompts (transformers: left padding with the pad token and an
attention mask). Each engine and batch size gets one untimed warm-up run, then `--repeats`
timed runs (engines interleaved run by run, so background load hits both alike); the median
is reported.

    python benchmarks/cpu_decode.py --max-new-tokens 64 --repeats 3 \
        --out benchmarks/results/cpu_decode.md

This is a benchmark, not a test: it takes minutes and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch

PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "List five tips for staying productive when working from home, with one sentence each.",
    "I am planning a weekend trip to the mountains. What should I pack, and how should I "
    "prepare if the weather forecast says it might rain?",
    "Describe the water cycle step by step: evaporation, condensation, precipitation and "
    "collection. Give an everyday example for each step so that a ten-year-old understands.",
    "You are helping a beginner learn Python. Explain what a list comprehension is, why it can "
    "be more readable than a for loop, when it should be avoided, and show a small example "
    "that squares the even numbers of a list.",
]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def num_cores() -> int:
    """What `nproc` prints: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


class FlashtreeRunner:
    name = "flashtree"

    def __init__(self, max_new_tokens: int) -> None:
        from flashtree import LLM, SamplingParams

        self.llm = LLM(model="default", device="cpu", dtype="float32")
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
        self.n = max_new_tokens

    def encode_chat(self, text: str) -> list[int]:
        assert self.llm.tokenizer is not None
        return self.llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])

    def generate(self, batch: list[list[int]]) -> list[list[int]]:
        outs = self.llm.generate(batch, self.params)
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(len(t) == self.n for t in ids), [len(t) for t in ids]
        return ids


class TransformersRunner:
    name = "transformers"

    def __init__(self, max_new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from flashtree.models.registry import default_model_path

        path = default_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
        ).eval()
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.n = max_new_tokens

    @torch.inference_mode()
    def generate(self, batch: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=self.n,
            min_new_tokens=self.n,
            pad_token_id=self.pad_id,
        )
        ids = out[:, width:].tolist()
        assert all(len(t) == self.n for t in ids), [len(t) for t in ids]
        return ids


def run_once(runner, prompts: list[list[int]], batch: int) -> tuple[float, list[list[int]]]:
    """Wall seconds of the generate call(s) and the generated ids, prompt order."""
    if batch == 1:
        total, outs = 0.0, []
        for p in prompts:
            dt, ids = timed(lambda p=p: runner.generate([p]))
            total += dt
            outs += ids
        return total, outs
    seconds, outs = 0.0, []
    for i in range(0, len(prompts), batch):
        dt, ids = timed(lambda i=i: runner.generate(prompts[i : i + batch]))
        seconds += dt
        outs += ids
    return seconds, outs


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(ft: list[list[int]], hf: list[list[int]], eos: set[int], n: int) -> str:
    """Matching greedy prefix per prompt. A mismatch right where flashtree emitted EOS is
    expected: transformers' min_new_tokens forbids EOS, flashtree's ignore_eos does not."""
    prefixes = [common_prefix(a, b) for a, b in zip(ft, hf, strict=True)]
    at_eos = sum(1 for p, a in zip(prefixes, ft, strict=True) if p < n and a[p] in eos)
    full = sum(1 for p in prefixes if p == n)
    text = f"{full}/{len(ft)} prompts identical; prefix min {min(prefixes)}, " + (
        f"mean {statistics.mean(prefixes):.1f} of {n}"
    )
    if at_eos:
        text += f" ({at_eos} split at an EOS that transformers suppresses)"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated, each dividing 8")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for both engines (default: nproc)")
    ap.add_argument("--out", default=None, help="also write the markdown report to this file")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 or len(PROMPTS) % b for b in batches):
        ap.error(f"--batch-sizes must divide {len(PROMPTS)}, got {args.batch_sizes}")
    if args.max_new_tokens < 1 or args.repeats < 1:
        ap.error("--max-new-tokens and --repeats must be >= 1")
    threads = args.threads or num_cores()
    torch.set_num_threads(threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(f"loading both engines (torch threads = {threads}) ...")
    ft = FlashtreeRunner(args.max_new_tokens)
    hf = TransformersRunner(args.max_new_tokens)
    prompts = [ft.encode_chat(p) for p in PROMPTS]
    hf_prompts = [
        list(hf.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
            return_dict=False,
        ))
        for p in PROMPTS
    ]
    if hf_prompts != prompts:
        log("warning: the two tokenizers render the chat prompts differently; using flashtree's")
    eos = set(ft.llm.engine.eos_token_ids)
    runners = [ft, hf]

    load_before = os.getloadavg()
    rates: dict[tuple[str, int], list[float]] = {}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for batch in batches:
        for r in runners:
            log(f"warm-up {r.name} batch {batch}")
            run_once(r, prompts, batch)
        for rep in range(args.repeats):
            for r in runners:
                seconds, outs = run_once(r, prompts, batch)
                rate = len(prompts) * args.max_new_tokens / seconds
                rates.setdefault((r.name, batch), []).append(rate)
                outputs[(r.name, batch)] = outs
                log(f"  {r.name:12s} batch {batch} run {rep + 1}: {seconds:7.2f} s  "
                    f"{rate:7.1f} tok/s")

    lines = [
        "| engine | batch | tokens/s (median) | runs (tokens/s) | flashtree / transformers "
        "| greedy agreement with transformers |",
        "|---|---:|---:|---|---:|---|",
    ]
    for batch in batches:
        ft_med = statistics.median(rates[("flashtree", batch)])
        hf_med = statistics.median(rates[("transformers", batch)])
        agree = agreement(outputs[("flashtree", batch)], outputs[("transformers", batch)], eos,
                          args.max_new_tokens)
        for name, med in (("flashtree", ft_med), ("transformers", hf_med)):
            runs = ", ".join(f"{x:.1f}" for x in rates[(name, batch)])
            ratio = f"{ft_med / hf_med:.2f}x" if name == "flashtree" else ""
            note = agree if name == "flashtree" else "(reference)"
            lines.append(f"| {name} | {batch} | {med:.1f} | {runs} | {ratio} | {note} |")
    table = "\n".join(lines)

    import transformers

    load_after = os.getloadavg()

    lens = [len(p) for p in prompts]
    report = "\n".join([
        "# CPU decode throughput: flashtree vs transformers",
        "",
        f"- command: `{shlex.join([os.path.basename(sys.executable), *sys.argv])}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: nproc {num_cores()}, CPU `{cpu_model()}`, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}, "
        f"torch threads {threads} (both engines); 1-min load average {load_before[0]:.2f} "
        f"before, {load_after[0]:.2f} after the timed runs",
        "- model: SmolLM2-135M-Instruct (embedded `model='default'`, Q4_1 GGUF dequantized to "
        "float32 by both engines), greedy",
        f"- workload: {len(prompts)} chat prompts of {min(lens)}-{max(lens)} tokens (chat "
        f"template), exactly {args.max_new_tokens} new tokens each; batch 1 = the prompts one "
        "generate call at a time, batch 8 = one call",
        "- tokens/s = generated tokens / wall time of the whole generate call(s), **prefill "
        f"included**; one warm-up run each, median of {args.repeats} runs, engines interleaved",
        "",
        table,
        "",
    ])
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
