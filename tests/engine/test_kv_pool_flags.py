"""The KV pool sized by the user (issue 66): `kv_cache_memory_gib` (`--kv-cache-memory-gib`)
fills that many GiB and not one page more, the CPU default follows the machine's available
memory (a quarter, at most 4 GiB), `gpu_memory_utilization` is vLLM's share of the GPU's total
memory, bad values are errors naming the argument and its range, and the CLI prints the pool
at start-up. Oracles: the bytes of the caches the engine allocated, the checkpoint's
config.json, psutil's reading of the machine's memory."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from flashtree import LLM
from flashtree.cli import build_parser, main
from flashtree.config import CacheConfig, EngineConfig, SchedulerConfig
from flashtree.runner import kv_pool
from tests.tiny import save_tiny_qwen3

GIB, MIB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("kv_pool_flags") / "t")


def _llm(path, **kw) -> LLM:
    """The tiny target on the CPU; 64 requests of 256 tokens want far more than the budgets
    below, so the budget decides the pool."""
    return LLM(model=str(path), device="cpu", max_model_len=256, max_num_seqs=64,
               skip_tokenizer_init=True, **kw)


def _page_bytes(llm: LLM) -> int:
    """One page of every cache the engine allocated, from the tensors (a scratch page each)."""
    e = llm.engine
    caches = [e.cache] + ([e.proposer.cache] if e.proposer else [])
    total = sum(c.k.nbytes + (0 if c.v is None else c.v.nbytes) for c in caches)
    assert total % (e.pages.num_pages + 1) == 0
    return total // (e.pages.num_pages + 1)


def test_kv_cache_memory_gib_fills_that_size_and_not_one_page_more(tiny_dir):
    for gib in (0.001, 0.003):  # not whole pages: the pool rounds down
        llm = _llm(tiny_dir, kv_cache_memory_gib=gib)
        pages, page = llm.engine.pages.num_pages, _page_bytes(llm)
        assert pages * page <= gib * GIB < (pages + 1) * page, (gib, pages, page)


def test_cpu_default_is_a_quarter_of_the_available_memory(tiny_dir, monkeypatch):
    page = _page_bytes(_llm(tiny_dir, kv_cache_pages=1))
    for pages in (100, 250):  # the pool follows the machine's memory
        available = 4 * pages * page + 3  # its quarter: `pages` pages and a part of one
        monkeypatch.setattr(kv_pool, "available_memory_bytes", lambda bytes_=available: bytes_)
        assert _llm(tiny_dir).engine.pages.num_pages == pages
    monkeypatch.setattr(kv_pool, "available_memory_bytes", lambda: 64 * GIB)
    assert kv_pool.cpu_default_budget() == 4 * GIB  # the cap


def test_available_memory_is_the_kernels_as_psutil_reads_it():
    psutil = pytest.importorskip("psutil")
    before = psutil.virtual_memory().available
    ours = kv_pool.available_memory_bytes()
    after = psutil.virtual_memory().available
    # Both read MemAvailable; other processes on a shared machine move it between the reads,
    # by far less than 256 MiB in the microseconds between them.
    assert min(before, after) - 256 * MIB <= ours <= max(before, after) + 256 * MIB


def test_gpu_memory_utilization_is_vllms_share_of_the_total(monkeypatch):
    """vLLM's meaning: the share of the GPU's total memory for this engine, its weights
    included, whatever other engines hold; its own example: two engines at 0.45 share a GPU."""
    total, weights, workspace = 80 * GIB, 10 * GIB, kv_pool.GPU_WORKSPACE_BYTES
    first = kv_pool.utilization_budget(0.45, total, free=total - weights, held=weights)
    assert first == int(0.45 * total) - weights - workspace
    used = weights + first + workspace  # the first engine running, its workspace in use
    second = kv_pool.utilization_budget(0.45, total, free=total - used - weights,
                                        held=weights)
    assert second == first
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.45 .* free.*lower it"):
        kv_pool.utilization_budget(0.45, total, free=total - 2 * used - weights, held=weights)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.1 .*raise it.*\(0, 1\]"):
        kv_pool.utilization_budget(0.1, total, free=total - weights, held=weights)
    # On a CUDA device the budget reads the device's total, free and reserved memory.
    free, held = total - 3 * weights, weights
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: held)
    cuda = torch.device("cuda")
    assert (kv_pool.memory_budget(CacheConfig(gpu_memory_utilization=0.45), cuda)
            == int(0.45 * total) - held - workspace)
    assert kv_pool.memory_budget(CacheConfig(), cuda) == free // 2  # the default


def test_a_queued_decode_forwards_logits_are_kept_outside_the_pool(tiny_dir, monkeypatch):
    """With the overlap on (CUDA by default), the pool leaves room for a queued decode's
    float32 logits of the rank's vocabulary slice, one row per request it may hold."""
    model = LLM(model=str(tiny_dir), device="cpu", skip_tokenizer_init=True).model
    args = EngineConfig(device=torch.device("cuda"), dtype=torch.float32,
                        scheduler=SchedulerConfig(max_num_seqs=256, max_model_len=256),
                        cache=CacheConfig(gpu_memory_utilization=0.5))
    queued = 256 * model.cfg.vocab_size * 4
    assert kv_pool.queued_decode_bytes(args, model) == queued
    assert kv_pool.queued_decode_bytes(replace(args, overlap_decode=False), model) == 0
    cpu = torch.device("cpu")
    assert kv_pool.queued_decode_bytes(replace(args, device=cpu), model) == 0
    assert kv_pool.queued_decode_bytes(replace(args, device=cpu, overlap_decode=True),
                                       model) == queued
    # A GPU whose half, less the workspace and the queued logits, holds 100 pages.
    page = kv_pool.kv_bytes_per_token(model, None, torch.float32) * args.cache.page_size
    total = 2 * (kv_pool.GPU_WORKSPACE_BYTES + queued + 100 * page)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    assert kv_pool.kv_pool_pages(args, model, None) == 100
    unqueued = kv_pool.kv_pool_pages(replace(args, overlap_decode=False), model, None)
    assert unqueued == 100 + queued // page


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_cache_memory_gib": 0}, r"kv_cache_memory_gib must be a size in GiB > 0, got 0"),
    ({"kv_cache_memory_gib": -2.0}, r"kv_cache_memory_gib must be a size in GiB > 0"),
    ({"kv_cache_memory_gib": float("nan")}, r"kv_cache_memory_gib must be a size in GiB > 0"),
    ({"kv_cache_memory_gib": float("inf")}, r"kv_cache_memory_gib must be a size in GiB > 0"),
    ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\], got 0"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"gpu_memory_utilization": float("nan")}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"gpu_memory_utilization": 0.9}, r"on a CUDA device, not on cpu.*kv_cache_memory_gib"),
    ({"kv_cache_pages": 8, "kv_cache_memory_gib": 1.0},
     r"kv_cache_pages and kv_cache_memory_gib each size the KV cache; give one"),
])
def test_bad_sizes_are_errors_naming_the_argument_and_range(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):  # before loading: no such model is read
        _llm(tmp_path / "never-loaded", **kwargs)


@pytest.mark.parametrize("flag, value, allowed", [
    ("--kv-cache-memory-gib", "0", "a size in GiB > 0"),
    ("--kv-cache-memory-gib", "nan", "a size in GiB > 0"),
    ("--kv-cache-memory-gib", "lots", "a size in GiB > 0"),
    ("--gpu-memory-utilization", "1.01", "in (0, 1]"),
    ("--gpu-memory-utilization", "-0.5", "in (0, 1]"),
])
def test_cli_refuses_bad_sizes_naming_the_flag(capsys, flag, value, allowed):
    for command in (["serve"], ["generate", "hi"], ["chat"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([*command, f"{flag}={value}"])
        assert exit_.value.code == 2
        assert f"argument {flag}: must be {allowed}, got {value}" in capsys.readouterr().err


def test_generate_prints_the_pool_at_start_up(tiny_chat_model, capsys):
    path, _ = tiny_chat_model
    gib = 0.002
    assert main(["generate", "Hi", "--model", str(path), "--device", "cpu", "--threads", "1",
                 "--max-tokens", "1", f"--kv-cache-memory-gib={gib}"]) == 0
    err = capsys.readouterr().err
    found = re.search(r"^KV cache: (\d+) tokens \((\d+) pages of (\d+)\) in (\S+) GiB$", err,
                      re.MULTILINE)
    assert found, err
    tokens, pages, page_size, shown = found.groups()
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    page_bytes = 16 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * 4
    assert int(page_size) == 16 and int(tokens) == 16 * int(pages)  # float32 K and V above
    assert int(pages) == int(gib * GIB) // page_bytes
    # Three significant digits are printed; the caches hold a scratch page past the pool.
    assert float(shown) == pytest.approx((int(pages) + 1) * page_bytes / GIB, rel=5e-3)
