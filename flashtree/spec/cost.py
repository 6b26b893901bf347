"""Measure the cost model of the adaptive speculation policy on this machine: target forward
time against tokens in the forward, and draft forward time against requests drafting, timed on
the engine's own runner with scratch requests. Profiles are cached as JSON under the flashtree
cache directory, keyed by everything that changes the numbers (models, dtype, device, TP size,
block size, batch limits)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from flashtree.engine.forward_batch import BatchItem, Mode, causal_mask
from flashtree.engine.model_runner import ModelRunner
from flashtree.kv.cache import PageTables
from flashtree.spec.budgets import CostModel
from flashtree.spec.dflash import DFlashProposer

_SCRATCH_ID = -1_000_000  # scratch request ids, below any real one (real ids count from 0)
_CHUNK = 16  # tokens per scratch request in a target forward (a verify block)
_REPEATS = 5  # timed runs per point (the fastest counts: noise only adds time), after a warm-up


def profile_path(key: dict) -> Path:
    root = Path(os.environ.get("FLASHTREE_CACHE", Path.home() / ".cache" / "flashtree"))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / "profiles" / f"{digest}.json"


def load_profile(key: dict) -> CostModel | None:
    path = profile_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        return CostModel(tuple(map(tuple, data["target"])), tuple(map(tuple, data["draft"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: measured again


def save_profile(key: dict, cost: CostModel) -> None:
    path = profile_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # ranks may write at once
    tmp.write_text(json.dumps({"key": key, "target": cost.target, "draft": cost.draft}))
    tmp.replace(path)


def _sizes(limit: int) -> list[int]:
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    return [*sizes, limit]


def _timed(run, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()  # warm-up
    times = []
    for _ in range(_REPEATS):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def lower_envelope(points: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """(size, seconds) points, ascending in size, with each time lowered to the fastest of
    its own and every larger size's: a forward of more tokens or blocks is not faster, so a
    point above a larger one's was slowed by noise (which, left in, would have the policy
    shun the budget that point prices, where the larger ones are as cheap)."""
    out, fastest = [], float("inf")
    for size, seconds in reversed(points):
        fastest = min(fastest, seconds)
        out.append((size, fastest))
    return tuple(reversed(out))


@torch.inference_mode()
def measure_cost_model(
    runner: ModelRunner, proposer: DFlashProposer, pages: PageTables, max_tokens: int,
    max_requests: int, block_size: int, tree: bool,
) -> CostModel:
    """Time target forwards of 1, 2, 4, ... `max_tokens` tokens (in verify blocks of up to 16,
    chains or, with `tree`, trees: what the engine's verify steps replay) and drafter forwards
    of 1, 2, 4, ... `max_requests` blocks of `block_size`. Scratch
    requests take pages for the measurement and give them back; the caches' contents are
    scratch beyond committed lengths anyway."""
    device = runner.device
    scratch: list[int] = []

    def reserve(count: int, length: int) -> list[int]:
        ids = [_SCRATCH_ID - i for i in range(count)]
        for seq_id in ids:
            pages.reserve(seq_id, length)
        scratch.extend(ids)
        return ids

    try:
        target = []
        for tokens in _sizes(max_tokens):
            ids = reserve(-(-tokens // _CHUNK), _CHUNK)
            sizes = [min(_CHUNK, tokens - i * _CHUNK) for i in range(len(ids))]
            items = [BatchItem(s, 0, [0] * n, all_logits=True,
                               positions=list(range(n)) if tree else None,
                               visible=causal_mask(n, device) if tree else None)
                     for s, n in zip(ids, sizes)]
            seconds = _timed(lambda it=items: runner.forward(Mode.VERIFY, it), device)
            target.append((tokens, seconds))
            _release(pages, scratch)
        draft = []
        for requests in _sizes(max_requests):
            ids = reserve(requests, block_size)
            blocks = [(s, 0, 0, block_size) for s in ids]
            draft.append((requests, _timed(lambda b=blocks: proposer.draft_logits(b), device)))
            _release(pages, scratch)
    finally:
        _release(pages, scratch)
    return CostModel(lower_envelope(target), lower_envelope(draft))


def _release(pages: PageTables, scratch: list[int]) -> None:
    for seq_id in scratch:
        pages.free(seq_id)
    scratch.clear()
