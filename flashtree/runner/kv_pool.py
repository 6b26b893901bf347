"""The KV pool's size in pages: what `CacheConfig` asks for, or as many as `max_num_seqs`
requests of `max_model_len` tokens need within the memory budget, for the target's cache and
the drafter's together; the same on every TP rank."""

from __future__ import annotations

import os

import torch

from flashtree.config import CacheConfig, EngineConfig
from flashtree.distributed import tp_min
from flashtree.kv.cache import KVCache, PageTables
from flashtree.models.dflash import DFlashDraftModel
from flashtree.models.llama import DecoderModel

GIB = 1 << 30
# On a CPU unless CacheConfig says: a quarter of the memory available at start-up (the rest
# for the weights, activations, other processes), at most vLLM's old CPU default of 4 GiB.
CPU_SHARE, CPU_CAP_BYTES = 0.25, 4 * GIB
# Under gpu_memory_utilization, kept outside the pool for what it does not profile: a step's
# activations, CUDA graphs and the CUDA context (an allowance, not a measurement); a queued
# decode's logits come on top (`queued_decode_bytes`).
GPU_WORKSPACE_BYTES = GIB


def kv_bytes_per_token(model: DecoderModel, drafter: DFlashDraftModel | None,
                       dtype: torch.dtype) -> int:
    """Bytes one token's K/V takes on this rank: every target layer's and drafter layer's."""
    kv_heads, k_dim, v_dim = model.kv_cache_dims()  # this rank's share
    elements = model.cfg.num_layers * kv_heads * (k_dim + v_dim)
    if drafter is not None:
        d = drafter.layers[0].self_attn
        elements += 2 * len(drafter.layers) * d.num_kv_heads * d.head_dim
    return elements * dtype.itemsize


def available_memory_bytes() -> int:
    """Memory the OS can hand out now: Linux's MemAvailable (free plus reclaimable caches),
    else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_default_budget() -> int:
    return min(int(available_memory_bytes() * CPU_SHARE), CPU_CAP_BYTES)


def queued_decode_bytes(args: EngineConfig, model: DecoderModel) -> int:
    """What a queued decode forward (`engine/decode_ahead.py`) holds beside the step's own:
    float32 logits of this rank's vocabulary slice for max_num_seqs requests (156 MB at 256
    requests and a 152k vocabulary); nothing without the overlap."""
    if not args.overlaps_decode:
        return 0
    return args.scheduler.max_num_seqs * model.lm_head.weight.shape[0] * 4


def utilization_budget(share: float, total: int, free: int, held: int,
                       workspace: int = GPU_WORKSPACE_BYTES) -> int:
    """The pool's bytes when the engine may use `share` of a GPU's `total` memory (vLLM's
    gpu_memory_utilization): that share less what this process `held` after loading (weights,
    buffers) and the `workspace`; an error when that is nothing or is not `free`."""
    budget = int(share * total) - held - workspace
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={share} of {total / GIB:.1f} GiB leaves no KV cache after "
            f"{held / GIB:.2f} GiB of weights and a {workspace / GIB:.2f} GiB "
            "workspace; raise it (allowed: (0, 1])")
    if budget + workspace > free:
        raise ValueError(
            f"gpu_memory_utilization={share} asks for a {budget / GIB:.2f} GiB KV cache but "
            f"the GPU has {free / GIB:.2f} GiB free (other processes hold "
            f"{(total - free - held) / GIB:.2f} GiB); lower it or free the GPU")
    return budget


def check_pool_device(cache: CacheConfig, device: torch.device) -> None:
    if cache.gpu_memory_utilization is not None and device.type != "cuda":
        raise ValueError(f"gpu_memory_utilization sizes the KV cache on a CUDA device, not on "
                         f"{device.type}; on a CPU give its size in GiB (kv_cache_memory_gib, "
                         "--kv-cache-memory-gib)")


def memory_budget(cache: CacheConfig, device: torch.device,
                  workspace: int = GPU_WORKSPACE_BYTES) -> int:
    """The bytes the pool may take: `memory_bytes`, or from `gpu_memory_utilization` (less
    the `workspace`); by default half the free GPU memory, or a share of the CPU's available
    memory."""
    check_pool_device(cache, device)
    if cache.memory_bytes is not None:
        return cache.memory_bytes
    if device.type != "cuda":
        return cpu_default_budget()
    free, total = torch.cuda.mem_get_info(device)
    if cache.gpu_memory_utilization is None:
        return free // 2
    return utilization_budget(cache.gpu_memory_utilization, total, free,
                              torch.cuda.memory_reserved(device), workspace)


def kv_pool_pages(args: EngineConfig, model: DecoderModel, drafter: DFlashDraftModel | None
                  ) -> int:
    """The pages every cache of the engine holds (each also has a scratch page past them):
    `args.cache.num_pages`, or those of `max_num_seqs` longest requests, capped by the
    memory budget (`memory_budget`) and never below one longest request. Every TP rank must
    schedule alike: all take the smallest rank's count."""
    cache, device = args.cache, args.device
    pages = cache.num_pages
    if pages is None:
        per_page = kv_bytes_per_token(model, drafter, args.dtype) * cache.page_size
        longest = cache.pages_for(args.scheduler.max_model_len)
        wanted = args.scheduler.max_num_seqs * longest
        workspace = GPU_WORKSPACE_BYTES + queued_decode_bytes(args, model)
        pages = max(longest, min(wanted, memory_budget(cache, device, workspace) // per_page))
    return tp_min(pages, device)


def pool_summary(pages: PageTables, caches: list[KVCache]) -> str:
    """The start-up line: the pool's tokens, pages and the bytes its caches hold on this rank
    (scratch pages included)."""
    nbytes = sum(c.k.nbytes + (0 if c.v is None else c.v.nbytes) for c in caches)
    return (f"KV cache: {pages.num_pages * pages.page_size} tokens ({pages.num_pages} pages "
            f"of {pages.page_size}) in {nbytes / GIB:.3g} GiB")
