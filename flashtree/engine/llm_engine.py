"""Synchronous engine: owns the model, KV cache, scheduler and runner; `step()` runs one forward
and returns the sequences that changed."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from flashtree.config import CacheConfig, ModelConfig, SchedulerConfig
from flashtree.engine.model_runner import ModelRunner
from flashtree.engine.scheduler import Scheduler
from flashtree.engine.sequence import Sequence
from flashtree.kv.cache import KVCache, PageTables
from flashtree.models.llama import DecoderModel
from flashtree.sampling import SamplingParams, sample_token
from flashtree.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineArgs:
    device: torch.device
    dtype: torch.dtype
    scheduler: SchedulerConfig
    cache: CacheConfig
    seed: int = 0


class LLMEngine:
    def __init__(
        self,
        model: DecoderModel,
        model_cfg: ModelConfig,
        tokenizer: Tokenizer | None,
        args: EngineArgs,
    ) -> None:
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.args = args
        kv_heads = model.layers[0].self_attn.num_kv_heads  # this rank's share
        bytes_per_token = (
            2 * model_cfg.num_layers * kv_heads * model_cfg.head_dim * args.dtype.itemsize
        )
        num_pages = args.cache.resolve_num_pages(
            args.scheduler.max_num_seqs, args.scheduler.max_model_len, bytes_per_token, args.device
        )
        self.cache = KVCache(
            model_cfg.num_layers, num_pages, args.cache.page_size, kv_heads, model_cfg.head_dim,
            args.dtype, args.device,
        )
        self.pages = PageTables(num_pages, args.cache.page_size)
        self.scheduler = Scheduler(args.scheduler, self.pages)
        self.runner = ModelRunner(model, self.cache, self.pages)
        self._ids = itertools.count()
        eos = set(model_cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate and queue one request. Raises ValueError naming what is wrong."""
        max_len = self.args.scheduler.max_model_len
        if not prompt_ids:
            raise ValueError("prompt is empty; give at least one token")
        if len(prompt_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_len}, so a prompt "
                f"may have at most {max_len - 1}"
            )
        vocab = self.model_cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        seq_id = next(self._ids)
        total = max_len if params.max_tokens is None else min(
            max_len, len(prompt_ids) + params.max_tokens
        )
        if self.args.cache.pages_for(total) > self.pages.num_pages:
            raise ValueError(
                f"request needs {total} tokens of KV cache but the pool holds only "
                f"{self.pages.num_pages * self.args.cache.page_size}; lower max_tokens"
            )
        seed = params.seed if params.seed is not None else hash((self.args.seed, seq_id))
        generator = torch.Generator(self.args.device).manual_seed(seed % (1 << 63))
        seq = Sequence(seq_id, list(prompt_ids), params, generator, total)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.abort(seq)

    def step(self) -> list[Sequence]:
        """Run one forward; return the sequences that got a new token."""
        chunks = self.scheduler.schedule()
        if not chunks:
            assert not self.scheduler.running, "running sequences but nothing scheduled"
            raise RuntimeError("no request fits in the KV cache; lower max_tokens or the prompt")
        logits = self.runner.forward(chunks)
        sampling = [c for c in chunks if c.samples]
        for row, chunk in enumerate(sampling):
            seq = chunk.seq
            was_decode = chunk.count == 1 and seq.output_ids
            token = sample_token(
                logits[row], seq.params, seq.generator, seq.prompt_ids, seq.output_ids
            )
            seq.output_ids.append(token)
            if was_decode:
                seq.spec_accept_lengths.append(1)
            self._check_finished(seq)
        return [c.seq for c in sampling]

    def _check_finished(self, seq: Sequence) -> None:
        params, token = seq.params, seq.output_ids[-1]
        if params.stop_strings and self.tokenizer is not None:
            text = self.decode(seq)
            hits = [i for i in (text.find(s) for s in params.stop_strings) if i >= 0]
            if hits:
                seq.text = text[: min(hits)]
                self.scheduler.finish(seq, "stop")
                return
        if (not params.ignore_eos and token in self.eos_token_ids) or (
            token in params.stop_token_ids
        ):
            self.scheduler.finish(seq, "stop")
        elif seq.num_tokens >= seq.max_total_len:
            self.scheduler.finish(seq, "length")
        if seq.is_finished and self.tokenizer is not None:
            seq.text = self.decode(seq)

    def decode(self, seq: Sequence) -> str:
        assert self.tokenizer is not None, "decode needs a tokenizer"
        return self.tokenizer.decode(seq.output_ids, seq.params.skip_special_tokens)
