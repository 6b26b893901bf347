"""Structured output under speculation: on the default pair (SmolLM2-135M-Instruct and its DFlash
drafter), chat requests for JSON answered freely and under a JSON schema, in every spec mode
with the fixed policy (speculation at every step), one request at a time, greedy. Reports the
tokens each target forward committed (acceptance), tokens/s against plain decoding measured in
the same run, and whether every speculative answer equals plain decoding's.

    python benchmarks/structured_bench.py --out benchmarks/results/DATE-structured-cpu.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import write_results  # noqa: E402
from flashtree import LLM, SamplingParams  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 40},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {
    "product": {"type": "string", "maxLength": 40}, "price": {"type": "number"},
    "in_stock": {"type": "boolean"},
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "black", "white"]},
               "maxItems": 3}},
    "required": ["product", "price", "in_stock", "colors"], "additionalProperties": False}
REQUESTS = [
    ("Describe a fictional person as JSON with name, age, city and hobbies.", PERSON),
    ("Give me a JSON object for a friend of mine who lives in Lisbon.", PERSON),
    ("Invent a chess player and describe them in JSON.", PERSON),
    ("Write a JSON record of a retired teacher.", PERSON),
    ("Describe a pair of running shoes for sale, as JSON.", PRODUCT),
    ("Return a JSON object describing a laptop in a shop.", PRODUCT),
    ("Make up a kitchen product and give its JSON listing.", PRODUCT),
    ("Describe a bicycle for sale as a JSON object.", PRODUCT),
]


def run(llm: LLM, constrained: bool, max_tokens: int) -> dict:
    """Every request once, one at a time: tokens, target forwards, seconds, answers."""
    tokens = steps = 0
    answers = []
    start = time.perf_counter()
    for ask, schema in REQUESTS:
        params = SamplingParams(temperature=0, max_tokens=max_tokens,
                                guided_json=schema if constrained else None)
        out = llm.chat([{"role": "user", "content": ask}], params)[0].outputs[0]
        tokens += len(out.token_ids)
        steps += len(out.spec_accept_lengths)
        answers.append(out.token_ids)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "decode_steps": steps, "seconds": seconds,
            "tokens_per_step": tokens / steps, "tokens_per_s": tokens / seconds,
            "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True, help="markdown report (JSON beside it)")
    args = ap.parse_args()
    runs: dict[str, dict] = {}
    for spec in ("none", "dflash", "ddtree"):
        llm = LLM(model="default", spec=spec, spec_policy="fixed", device=args.device,
                  max_model_len=1024, max_num_seqs=1)
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))  # warm-up
        for constrained in (False, True):
            runs[f"{spec}/{'schema' if constrained else 'free'}"] = run(llm, constrained,
                                                                         args.max_tokens)
        del llm
    for key, r in runs.items():
        plain = runs[f"none/{key.split('/')[1]}"]
        r["over_none"] = r["tokens_per_s"] / plain["tokens_per_s"]
        r["equals_none"] = r["answers"] == plain["answers"]
    res = {"machine": (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                       else platform.processor() or "CPU") + f", torch {torch.__version__}",
           "command": "python benchmarks/structured_bench.py " + " ".join(sys.argv[1:]),
           "runs": runs}
    for spec in ("dflash", "ddtree"):
        res[f"{spec}_acceptance_schema_over_free"] = (
            runs[f"{spec}/schema"]["tokens_per_step"] / runs[f"{spec}/free"]["tokens_per_step"])
    lines = ["# Structured output under speculation", "",
             f"Machine: {res['machine']}. Command: `{res['command']}`. {len(REQUESTS)} chat "
             f"requests for JSON (two schemas), greedy, at most {args.max_tokens} tokens, one "
             "at a time, fixed policy.", "",
             "| spec | output | tokens | tokens per step | tok/s over none | equals none |",
             "|---|---|---|---|---|---|"]
    for key, r in runs.items():
        spec, output = key.split("/")
        lines.append(f"| {spec} | {output} | {r['tokens']} | {r['tokens_per_step']:.2f} | "
                     f"{r['over_none']:.2f} | {r['equals_none']} |")
    lines += ["", "Acceptance (tokens per step) under the schema over free output: DFlash "
              f"{res['dflash_acceptance_schema_over_free']:.2f}, DDTree "
              f"{res['ddtree_acceptance_schema_over_free']:.2f}.", ""]
    for r in runs.values():
        r.pop("answers")
    write_results(args.out, "\n".join(lines), res)


if __name__ == "__main__":
    main()
