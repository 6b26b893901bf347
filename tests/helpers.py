"""Shared test helpers: tiny random checkpoints written by transformers itself (with non-trivial
biases and norm weights), and a harness that drives flashtree's model through the paged KV cache
with explicit chunks so that tests can read the logits of every position."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from flashtree.engine.model_runner import ModelRunner
from flashtree.engine.scheduler import ScheduledChunk
from flashtree.engine.sequence import Sequence
from flashtree.kv.cache import KVCache, PageTables
from flashtree.models.llama import DecoderModel
from flashtree.sampling import SamplingParams

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


def config_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@torch.no_grad()
def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits of every position of one unpadded sequence: [len, vocab]."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def reference_hidden_states(hf_model, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' hidden_states tuple (embeddings, then one entry per layer), batch removed."""
    out = hf_model(torch.tensor([tokens]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


@dataclass
class PagedHarness:
    """flashtree's model over its own paged KV cache, fed chunk lists by hand (the shapes the
    scheduler produces: whole-prompt prefills, continuation chunks and single-token decodes)."""

    model: DecoderModel
    page_size: int = 4
    num_pages: int = 96

    def __post_init__(self) -> None:
        cfg = self.model.cfg
        kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.cache = KVCache(
            cfg.num_layers, self.num_pages, self.page_size, kv_heads, cfg.head_dim,
            self.model.embed_tokens.weight.dtype, self.model.embed_tokens.weight.device,
        )
        self.pages = PageTables(self.num_pages, self.page_size)
        self.runner = ModelRunner(self.model, self.cache, self.pages)
        self._next_id = 0

    def new_seq(self, prompt: list[int]) -> Sequence:
        seq = Sequence(
            self._next_id, list(prompt), SamplingParams(temperature=0), torch.Generator(), 1 << 20
        )
        self._next_id += 1
        return seq

    def reserve_interleaved(self, chunks: list[ScheduledChunk]) -> None:
        """Reserve pages one page per sequence in turn, so that no sequence's pages are
        contiguous in the pool."""
        ends = [c.start + c.count for c in chunks]
        done = False
        upto = 0
        while not done:
            upto += self.page_size
            done = True
            for c, end in zip(chunks, ends):
                self.pages.reserve(c.seq.seq_id, min(end, upto))
                done = done and upto >= end

    @torch.inference_mode()
    def forward_all(
        self, chunks: list[ScheduledChunk], capture_layers: tuple[int, ...] = ()
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """One forward over `chunks` (pages must be reserved); returns the logits of every new
        token per chunk ([count, vocab] each) and, per chunk, the captured layer outputs."""
        ids: list[int] = []
        positions: list[int] = []
        for c in chunks:
            ids += c.seq.token_slice(c.start, c.start + c.count)
            positions += range(c.start, c.start + c.count)
        meta = self.runner.build_metadata(chunks)
        self.runner.backend.begin_forward(meta)
        hidden, captured = self.model(
            torch.tensor(ids), torch.tensor(positions), self.runner.backend, capture_layers
        )
        logits = self.model.compute_logits(hidden)
        for c in chunks:
            c.seq.num_computed = c.start + c.count
            self.pages.set_length(c.seq.seq_id, c.seq.num_computed)
        sizes = [c.count for c in chunks]
        per_chunk_captured = [list(parts) for parts in zip(*(t.split(sizes) for t in captured))]
        if not capture_layers:
            per_chunk_captured = [[] for _ in chunks]
        return list(logits.split(sizes)), per_chunk_captured
