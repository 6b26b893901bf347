"""In-process load: at most `concurrency` requests in the engine at a time, the next one sent
as soon as one finishes; each step's new tokens are one timed chunk of their request."""

from __future__ import annotations

import time
from collections import deque

from flashtree.bench.datasets import BenchPrompt
from flashtree.bench.metrics import RequestRecord
from flashtree.llm import LLM
from flashtree.sampling import SamplingParams


def encode(llm: LLM, prompt: BenchPrompt) -> list[int]:
    if prompt.token_ids is not None:
        return prompt.token_ids
    if llm.tokenizer is None:
        raise ValueError("chat datasets need a tokenizer; use --dataset random")
    return llm.tokenizer.apply_chat_template(prompt.messages)


def run_offline(
    llm: LLM, prompts: list[BenchPrompt], concurrency: int, max_tokens: int,
    temperature: float = 0.0, seed: int = 0, on_finish=None,
) -> tuple[list[RequestRecord], float]:
    """Returns one record per prompt (in prompt order) and the wall time of the run."""
    engine = llm.engine
    encoded = [encode(llm, p) for p in prompts]
    queue = deque(range(len(prompts)))
    records: list[RequestRecord | None] = [None] * len(prompts)
    active: dict = {}  # Sequence -> (record, tokens seen)
    start = time.perf_counter()
    while queue or active:
        while queue and len(active) < concurrency:
            i = queue.popleft()
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                    seed=seed + i, ignore_eos=prompts[i].ignore_eos)
            rec = RequestRecord(time.perf_counter(), len(encoded[i]))
            records[i] = rec
            try:
                active[engine.add_request(encoded[i], params)] = rec
            except ValueError as e:  # e.g. the prompt does not fit: a failed request
                rec.error = str(e)
        if not active:
            continue
        engine.step()
        now = time.perf_counter()
        for seq, rec in list(active.items()):
            new = len(seq.output_ids) - rec.num_output
            if new > 0:
                rec.chunks.append((now, new))
            if seq.is_finished:
                rec.end, rec.accept_lengths = now, list(seq.spec_accept_lengths)
                rec.token_ids = list(seq.output_ids)
                rec.error = seq.error
                del active[seq]
                if on_finish is not None:
                    on_finish()
    return [r for r in records if r is not None], time.perf_counter() - start
