"""Shared test helpers: tiny random checkpoints written by transformers itself (with non-trivial
biases and norm weights), and a harness that drives flashtree's ModelRunner over the paged KV
cache with hand-built batches so that tests can read the logits of every position."""

from __future__ import annotations

from pathlib import Path

import torch

from flashtree.engine.scheduler import step_kind
from flashtree.kv.cache import KVCache, PageTables
from flashtree.models.llama import DecoderModel
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.runner.model_runner import ModelRunner

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _classes(arch: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[arch]


def save_checkpoint(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    max_shard_size: int | str | None = None,
    **overrides,
) -> Path:
    """Write a tiny random fp32 `arch` checkpoint to `path` with transformers' save_pretrained.

    transformers initializes biases to zero and norm weights to one; both are re-drawn here so a
    loader that drops or misplaces them produces different logits."""
    config_cls, model_cls = _classes(arch)
    cfg = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def load_reference(path: Path, arch: str = "llama"):
    """The checkpoint as transformers itself reads it back from disk (fp32, eval)."""
    _, model_cls = _classes(arch)
    return model_cls.from_pretrained(path, dtype=torch.float32).eval()


def checkpoint_tensor_names(path: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names


@torch.no_grad()
def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits of every position of one unpadded sequence: [len, vocab]."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def reference_hidden_states(hf_model, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' hidden_states tuple (embeddings, then one entry per layer), batch removed."""
    out = hf_model(torch.tensor([tokens]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


class PagedHarness:
    """flashtree's model behind its ModelRunner over a paged KV cache, fed batches by hand (the
    shapes the engine produces: whole-prompt prefills, continuation chunks, single-token
    decodes), with pages handed out one page per sequence in turn so that no sequence's pages
    are contiguous in the pool."""

    def __init__(
        self, model: DecoderModel, page_size: int = 4, num_pages: int = 96,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        cfg = model.cfg
        weight = model.embed_tokens.weight
        kv_heads, k_dim, v_dim = model.kv_cache_dims()
        self.model = model
        self.num_pages = num_pages
        self.cache = KVCache(
            cfg.num_layers, num_pages, page_size, kv_heads, k_dim, weight.dtype,
            weight.device, v_head_dim=v_dim,
        )
        self.pages = PageTables(num_pages, page_size)
        self.runner = ModelRunner(model, self.cache, self.pages, capture_layers)

    def reserve_interleaved(self, items: list[BatchItem]) -> None:
        ends = [it.start + len(it.tokens) for it in items]
        page = self.pages.page_size
        for upto in range(page, max(ends) + page, page):
            for it, end in zip(items, ends):
                self.pages.reserve(it.seq_id, min(end, upto))

    def forward(
        self, mode: Mode, items: list[BatchItem]
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Reserve pages, run one forward through ModelRunner and commit the KV lengths.
        Returns the scored logits split per item ([rows, vocab] each) and the captured
        features ([num_tokens, len(capture_layers) * hidden] or None)."""
        self.reserve_interleaved(items)
        logits, features = self.runner.forward(mode, items)
        for it in items:
            self.pages.set_length(it.seq_id, it.start + len(it.tokens))
        counts = [
            (len(it.tokens) if it.all_logits else 1) if it.wants_logits else 0 for it in items
        ]
        assert logits.shape[0] == sum(counts), (tuple(logits.shape), counts)
        return list(logits.split(counts)), features

    def prefill_all_logits(
        self, prompts: list[list[int]], first_id: int = 0
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Prefill `prompts` (sequence ids first_id, first_id + 1, ...) in ONE forward and
        return the logits of every position of each."""
        items = [
            BatchItem(first_id + i, 0, list(p), all_logits=True) for i, p in enumerate(prompts)
        ]
        return self.forward(Mode.PREFILL, items)


def record_schedules(engine) -> list[list]:
    """The chunks of every step `engine` schedules from now on, appended as it schedules."""
    steps: list[list] = []
    schedule = engine.scheduler.schedule

    def recorded():
        chunks = schedule()
        steps.append(chunks)
        return chunks

    engine.scheduler.schedule = recorded
    return steps


def ran_mixed_steps(steps: list[list]) -> bool:
    """Whether any of `record_schedules`'s steps carried prompt chunks and decode tokens."""
    return any(step_kind(chunks) == "mixed" for chunks in steps)


def fp8_block_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style e4m3 block quantization of w [out, in]: (float8 weight, float32 scales
    [ceil(out / block), ceil(in / block)], one amax / 448 per block)."""
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    pad = torch.zeros(rows * block, cols * block, device=w.device)
    pad[:out, :inp] = w
    blocks = pad.view(rows, block, cols, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [rows, cols]
    full = scale.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def run_ranks(fn, nprocs: int = 2) -> dict:
    """Spawn `nprocs` processes running `fn(rank, port, out)` (a module-level function; `port`
    free for a tcp:// group, `out` a shared dict) and return what they put in `out`."""
    import torch.multiprocessing as mp

    from flashtree.distributed.tp import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(fn, args=(free_port(), out), nprocs=nprocs, join=True)
        return dict(out)
