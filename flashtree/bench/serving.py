"""Load over HTTP against any OpenAI-compatible server (flashtree, vLLM, SGLang): streaming
requests with the `openai` client at a fixed concurrency and optionally a Poisson request rate;
acceptance from the server's speculative-decoding counters on /metrics when it has them."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from flashtree.bench.datasets import BenchPrompt
from flashtree.bench.metrics import RequestRecord

_DRAFTS, _ACCEPTED = "spec_decode_num_drafts", "spec_decode_num_accepted_tokens"
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


def metrics_url(base_url: str) -> str:
    root = base_url.rstrip("/")
    return (root[: -len("/v1")] if root.endswith("/v1") else root) + "/metrics"


def spec_counters(text: str) -> dict[str, float] | None:
    """Speculative counters in a Prometheus exposition: {"drafts", "accepted", "pos0", "pos1",
    ...} under the flashtree: prefix, else the vllm: one (flashtree exports both); None when the
    server exports neither."""
    from prometheus_client.parser import text_string_to_metric_families

    by_prefix: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            prefix, _, name = sample.name.rpartition(":")
            name = name.removesuffix("_total")
            key = ("drafts" if name == _DRAFTS else "accepted" if name == _ACCEPTED else
                   f"pos{sample.labels['position']}" if name == _PER_POS
                   and "position" in sample.labels else None)
            if key is not None:
                found = by_prefix.setdefault(prefix, {})
                found[key] = found.get(key, 0.0) + sample.value
    for prefix in ("flashtree", *sorted(by_prefix)):
        found = by_prefix.get(prefix, {})
        if "drafts" in found and "accepted" in found:
            return found
    return None


def acceptance_from_counters(before: dict, after: dict) -> tuple[float, dict[str, int]] | None:
    """Mean acceptance length 1 + accepted / drafts over the run, and its histogram from the
    per-position counters (drafts accepting at least k candidates = accepted_per_pos[k-1])."""
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return None
    mean = 1 + (after["accepted"] - before["accepted"]) / drafts
    at_least = [drafts]  # at_least[k]: drafts that accepted >= k candidates
    k = 0
    while f"pos{k}" in after:
        at_least.append(after[f"pos{k}"] - before.get(f"pos{k}", 0.0))
        k += 1
    at_least.append(0.0)
    hist = {str(k + 1): int(round(at_least[k] - at_least[k + 1])) for k in range(len(at_least) - 1)}
    return mean, {k: v for k, v in hist.items() if v}


async def _one(client, model: str, prompt: BenchPrompt, max_tokens: int, temperature: float,
               seed: int) -> RequestRecord:
    rec = RequestRecord(time.perf_counter(), 0)
    common = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
              "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    if prompt.ignore_eos:
        common["extra_body"] = {"ignore_eos": True}
    try:
        if prompt.messages is not None:
            stream = await client.chat.completions.create(messages=prompt.messages, **common)
        else:
            stream = await client.completions.create(prompt=prompt.token_ids, **common)
        async for chunk in stream:
            if chunk.usage is not None:
                rec.prompt_tokens = chunk.usage.prompt_tokens
                rec.output_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                piece = choice.delta.content if hasattr(choice, "delta") else choice.text
                if piece:
                    rec.chunks.append((time.perf_counter(), 1))
        rec.end = time.perf_counter()
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_serving(
    base_url: str, model: str, prompts: list[BenchPrompt], concurrency: int, max_tokens: int,
    temperature: float = 0.0, request_rate: float = float("inf"), seed: int = 0,
    api_key: str | None = None, on_finish=None,
) -> tuple[list[RequestRecord], float, tuple[float, dict[str, int]] | None]:
    """Returns the records (prompt order), the wall time, and the acceptance measured from the
    server's counters (None when it exports none)."""
    from openai import AsyncOpenAI

    async with httpx.AsyncClient(timeout=30) as http:
        async def counters():
            try:
                r = await http.get(metrics_url(base_url))
                return spec_counters(r.text) if r.status_code == 200 else None
            except httpx.HTTPError:
                return None

        before = await counters()
        client = AsyncOpenAI(base_url=base_url, api_key=api_key or "EMPTY", max_retries=0,
                             timeout=3600)
        gate = asyncio.Semaphore(concurrency)
        rng = random.Random(seed)

        async def limited(i: int, prompt: BenchPrompt) -> RequestRecord:
            async with gate:
                rec = await _one(client, model, prompt, max_tokens, temperature, seed + i)
            if on_finish is not None:
                on_finish()
            return rec

        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(i, prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        await client.close()
        after = await counters()
    accept = acceptance_from_counters(before, after) if before and after else None
    return records, duration, accept
