"""Synchronous engine: owns the model, KV cache, scheduler and runner; `step()` runs one
scheduled forward (plain or speculative) and returns the sequences that got new tokens."""

from __future__ import annotations

import functools
import itertools
import time

import torch

from flashtree.config import EngineConfig
from flashtree.distributed import get_tp_size
from flashtree.distributed.vocab import vocab_argmax
from flashtree.engine.decode_ahead import QueuedDecode, queue_decode
from flashtree.engine.output_processor import OutputProcessor
from flashtree.engine.scheduler import ScheduledChunk, Scheduler, step_kind
from flashtree.kv.cache import KVCache, PageTables
from flashtree.models.config import ModelConfig
from flashtree.models.dflash import DFlashDraftModel
from flashtree.models.llama import DecoderModel
from flashtree.runner.capture import mixes_in_graphs, plan_graphs
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.runner.kv_pool import kv_pool_pages
from flashtree.runner.model_runner import ModelRunner
from flashtree.sampling import SamplingParams, SamplingRow, sample_tokens
from flashtree.sequence import Sequence
from flashtree.speculative.policy import AdaptivePolicy, FixedPolicy, SpecPolicy, StepResult
from flashtree.speculative.proposer import ContextRows, DFlashProposer
from flashtree.speculative.stats import SpecStats
from flashtree.speculative.step import SpeculativeStep
from flashtree.structured_output import GrammarCompiler, mask_by_grammar
from flashtree.tokenizer import Tokenizer
from flashtree.transfer import start_to_host


class LLMEngine:
    def __init__(
        self,
        model: DecoderModel,
        model_cfg: ModelConfig,
        tokenizer: Tokenizer | None,
        args: EngineConfig,
        drafter: DFlashDraftModel | None = None,
    ) -> None:
        assert (drafter is None) == (args.spec is None), "a drafter goes with a SpecConfig"
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.args = args
        kv_heads, k_dim, v_dim = model.kv_cache_dims()  # this rank's share
        num_pages = kv_pool_pages(args, model, drafter)
        # One page more than the page tables hand out: its first slot takes the K/V of a
        # captured graph's padded tokens.
        self.cache = KVCache(
            model_cfg.num_layers, num_pages + 1, args.cache.page_size, kv_heads, k_dim,
            args.dtype, args.device, v_head_dim=v_dim,
        )
        self.pages = PageTables(num_pages, args.cache.page_size, args.cache.prefix_caching)
        self.proposer: DFlashProposer | None = None
        self.speculative: SpeculativeStep | None = None
        self.policy: SpecPolicy | None = None
        # Speculation counters (server/metrics.py), recorded by this class only.
        self.spec_stats: SpecStats | None = None
        spec = args.spec
        self.lookahead = 0 if spec is None else spec.lookahead
        if drafter is not None:
            drafter.cfg.check_target(model_cfg)
            self.proposer = DFlashProposer(drafter, model, self.pages, args.dtype, args.device)
            self.pages.before_release = self.proposer.flush
        self.scheduler = Scheduler(args.scheduler, self.pages)
        self.runner = ModelRunner(model, self.cache, self.pages,
                                  drafter.cfg.target_layer_ids if drafter is not None else ())
        plan = plan_graphs(args, self.pages.scratch_slot)
        if plan is not None:
            if self.proposer is not None:
                self.proposer.capture_graphs(plan)
            self.runner.capture_graphs(
                plan.dims, plan.buckets, plan.target,
                context_writer=None if self.proposer is None else self.proposer.write_context)
            self.scheduler.mixes = functools.partial(mixes_in_graphs, self.runner.graphs)
        if spec is not None:
            assert self.proposer is not None
            self.speculative = SpeculativeStep(spec, self.proposer, self.runner, self.cache,
                                               self.pages)
            self.spec_stats = SpecStats()
            self.policy = (AdaptivePolicy(spec.budgets) if spec.policy == "adaptive"
                           else FixedPolicy(spec.max_budget))
        self._ids = itertools.count()
        eos = set(model_cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.outputs = OutputProcessor(self.scheduler, tokenizer, frozenset(eos))
        self._grammars: GrammarCompiler | None = None  # built for the first guided request
        # Greedy plain steps queue the next decode before their read (`decode_ahead`), by
        # default on CUDA; counted: steps taking one, ones none took.
        self.overlap_decode, self._queued = args.overlaps_decode, None
        self.overlapped_decode_steps = self.dropped_decode_steps = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate and queue one request. Raises ValueError naming what is wrong."""
        max_len = self.args.scheduler.max_model_len
        if params.n != 1:
            raise ValueError(f"n={params.n}: the engine takes one choice per request; add "
                             "params.choice(i) for each (LLM.generate and the server do)")
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
        total = max_len if params.max_tokens is None else min(
            max_len, len(prompt_ids) + params.max_tokens
        )
        if self.args.cache.pages_for(total + self.lookahead) > self.pages.num_pages:
            raise ValueError(
                f"request needs {total + self.lookahead} tokens of KV cache (prompt, max_tokens "
                f"and {self.lookahead} speculative) but the pool holds only "
                f"{self.pages.num_pages * self.args.cache.page_size}; lower max_tokens"
            )
        matcher = self._grammar_compiler().matcher(params) if params.guided_field else None
        seq_id = next(self._ids)  # only accepted requests take an id (TP ranks replay adds)
        seed = (params.seed if params.seed is not None
                else hash((self.args.seed, seq_id))) % (1 << 63)
        generator = torch.Generator(self.args.device).manual_seed(seed)
        seq = Sequence(seq_id, list(prompt_ids), params, seed, generator, total,
                       matcher=matcher)
        self.scheduler.add(seq)
        return seq

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this engine was "
                             "built without one (skip_tokenizer_init)")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.hf, self.model_cfg.vocab_size,
                                             self.outputs.eos_token_ids)
        return self._grammars

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.abort(seq)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Sequence]:
        """Run one forward; return the sequences that got new tokens."""
        queued, self._queued = self._queued, None  # a plain decode step may take it
        try:
            return self._step(queued)
        finally:
            self.dropped_decode_steps += queued is not None and not queued.taken

    def _step(self, queued: QueuedDecode | None) -> list[Sequence]:
        start = time.perf_counter()  # the policy times whole steps, scheduling included
        chunks = self.scheduler.schedule()
        if not chunks:
            assert not self.scheduler.running, "running sequences but nothing scheduled"
            raise RuntimeError("no request fits in the KV cache; lower max_tokens or the prompt")
        kind = step_kind(chunks)
        if self.speculative is None or kind != "decode":
            if self.spec_stats is not None and kind == "mixed":  # plain for the decoding
                self.spec_stats.record_budget(0, sum(c.decode for c in chunks))
            return self._plain_step(chunks, queued)
        outputs_before = sum(len(c.seq.output_ids) for c in chunks)
        assert self.policy is not None and self.spec_stats is not None
        budget = self.policy.plan(len(chunks))
        committed_at = None
        if budget > 0 and self._reserve_lookahead(chunks):
            self.spec_stats.record_speculative_step(len(chunks))
            done, committed_at = self._speculative_step(chunks, budget)
        else:
            budget = 0
            self.spec_stats.record_budget(0, len(chunks))
            done = self._plain_step(chunks, queued)
        committed = sum(len(c.seq.output_ids) for c in chunks) - outputs_before
        self.policy.observe(StepResult(budget, len(chunks), committed,
                                       time.perf_counter() - start, committed_at))
        return done

    def _reserve_lookahead(self, chunks: list[ScheduledChunk]) -> bool:
        """Pages for what a speculative step writes past each sequence (its draft block and
        candidates). When they are not free the step runs plain instead of preempting anyone;
        plain steps never hold them."""
        wanted = [(c.seq.seq_id, c.seq.num_tokens + self.lookahead) for c in chunks]
        if sum(self.pages.pages_needed(s, n) for s, n in wanted) > self.pages.num_free:
            return False
        for seq_id, tokens in wanted:
            self.pages.reserve(seq_id, tokens)
        return True

    def _plain_step(self, chunks: list[ScheduledChunk], queued: QueuedDecode | None = None
                    ) -> list[Sequence]:
        """Prompt chunks, one plain decode token per request, or both (a mixed step, run as
        a prompt batch). With a drafter, the new tokens' context features go to the draft KV
        cache before the next draft: the first token of a prompt does not wait for them, nor
        does a plain step the policy chose (a decode or prompt graph writes them itself, and
        returns none). `queued`: the decode forward the step before queued, whose rows answer
        the decode chunks where they can (a mixed step then runs its prompt chunks alone); a
        greedy step queues the next one's (`decode_ahead`)."""
        # Chunks of prompts whose log-probs are asked score every row, the others their last
        # row where they sample.
        scores_prompt = [not c.decode and c.seq.wants_prompt_logprobs for c in chunks]
        sampling = [c for c in chunks if c.samples]
        # All-greedy batches take the argmax over TP vocab slices without gathering logits.
        all_greedy = (all(c.seq.params.argmax_only for c in sampling)
                      and not any(scores_prompt))
        decode = [c for c in chunks if c.decode]  # a step's decode chunks come first
        rows = queued.rows_for(decode) if queued is not None and decode and all_greedy else None
        parts = []  # (chunks, mode, logits, features, positions, slots) of each forward
        if rows is not None:
            parts.append((decode, Mode.DECODE, *queued.take(rows)))
            self.overlapped_decode_steps += 1
        if rest := chunks[len(decode):] if rows is not None else chunks:
            parts.append((rest, *self._forward(rest, scores_prompt[-len(rest):], all_greedy)))
        logits = parts[0][2] if len(parts) == 1 else torch.cat([p[2] for p in parts])
        if any(scores_prompt):
            logits = self.outputs.record_prompt_logprobs(chunks, scores_prompt, logits)
        for c in chunks:
            c.seq.num_computed = c.start + c.count
            self.pages.set_length(c.seq.seq_id, c.seq.num_computed)
        for part in parts:
            self._defer_context(*part)
        if any(c.seq.matcher is not None for c in sampling):
            logits = mask_by_grammar(logits, [(c.seq.matcher, [c.seq.last_token], [0])
                                              for c in sampling])
        if not sampling:
            tokens = []
        elif all_greedy:  # one device read for the batch
            tokens = self._greedy_tokens(logits, sampling)
        else:
            tokens = self._sample(logits, sampling)
        for i, (c, token) in enumerate(zip(sampling, tokens)):
            if token is not None:
                with self.outputs.isolated(c.seq):
                    self.outputs.append(c.seq, [token], record=c.decode, logits=logits[i : i + 1])
        if self._queued is not None and not self.scheduler.running:
            self._queued = None  # every request ended: nothing will take it
            self.dropped_decode_steps += 1
        return [c.seq for c in sampling]

    def _forward(self, chunks: list[ScheduledChunk], scores_prompt: list[bool],
                 all_greedy: bool) -> tuple:
        """The target forward of `chunks` -> (mode, scored rows' logits, features, positions,
        KV slots)."""
        mode = Mode.DECODE if step_kind(chunks) == "decode" else Mode.PREFILL
        items = [BatchItem(c.seq.seq_id, c.start, c.seq.token_slice(c.start, c.start + c.count),
                           all_logits=every, wants_logits=c.samples or every)
                 for c, every in zip(chunks, scores_prompt)]
        logits, features = self.runner.forward(mode, items, gather_logits=not all_greedy)
        batch = self.runner.last_batch
        return mode, logits, features, batch.positions, batch.attn.slot_mapping

    def _defer_context(self, chunks: list[ScheduledChunk], mode: Mode, logits: torch.Tensor,
                       features: torch.Tensor | None, positions: torch.Tensor,
                       slots: torch.Tensor) -> None:
        """Keep a forward's context features for the next draft (where it returned them)."""
        if self.proposer is None or features is None:
            return
        # The rows' positions and slots are the target batch's (the caches share pages).
        leases = self.pages.leases([c.seq.seq_id for c in chunks])
        assert None not in leases, "a chunk's request holds no pages (its forward wrote them)"
        self.proposer.defer(ContextRows(
            features, positions=positions, slots=slots, leases=leases,
            counts=None if mode == Mode.DECODE else tuple(c.count for c in chunks)))

    def _greedy_tokens(self, logits: torch.Tensor, sampling: list[ScheduledChunk]
                       ) -> list[int]:
        """The argmax of each row, read in one copy; first the next step's decode of the
        `sampling` chunks' requests is queued, where it will run plain (`decode_ahead`)."""
        next_ids = vocab_argmax(logits, self.runner.model.lm_head.vocab_start)
        read = start_to_host(next_ids)  # before the next step queues behind it
        if self.overlap_decode:
            try:
                self._queued = queue_decode(self.runner, self.pages, self.scheduler,
                                            sampling, next_ids, self._plain_next)
            except torch.OutOfMemoryError:  # the step goes on without it
                self._queued = None
        return read().tolist()

    def _plain_next(self, requests: int) -> bool:
        """Whether the next decode step of `requests` requests runs plain, as every rank can
        tell: without a drafter; with one, where the policy (one process: under tensor
        parallelism only rank 0's knows) plans no speculation for it now."""
        if self.policy is None:
            return True
        return get_tp_size() == 1 and self.policy.decisions().plan(requests) == 0

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[int | None]:
        """One token per chunk (logits [len(chunks), vocab]), drawn for the whole batch at once;
        if that fails, row by row so that only the failing requests fail (their token: None)."""
        rows = [SamplingRow(c.seq.params, c.seq.seed, c.seq.prompt_ids, c.seq.output_ids)
                for c in chunks]
        try:
            return sample_tokens(logits, rows)
        except Exception:  # noqa: BLE001 - retried per request below
            tokens: list[int | None] = []
            for i, c in enumerate(chunks):
                tokens.append(None)
                with self.outputs.isolated(c.seq):
                    tokens[-1] = sample_tokens(logits[i : i + 1], rows[i : i + 1])[0]
            return tokens

    def _speculative_step(self, chunks: list[ScheduledChunk], budget: int
                          ) -> tuple[list[Sequence], dict[int, int] | None]:
        """The step at `budget`; also what the batch would have committed at each smaller
        budget of the config's where every request's tree tells (None: not every one)."""
        assert self.speculative is not None and self.spec_stats is not None
        seqs = [c.seq for c in chunks]
        smaller = [b for b in self.speculative.cfg.budgets if b < budget]
        committed_at: dict[int, int] | None = dict.fromkeys([*smaller, budget], 0)
        for seq, verified in zip(seqs, self.speculative.run(seqs, budget)):
            self.spec_stats.record_budget(verified.num_candidates)
            committed = None  # stays None where the request failed
            with self.outputs.isolated(seq):
                self.outputs.append(seq, verified.tokens, record=True, logits=verified.logits)
                # Counted after stop conditions, so the counters match the returned tokens.
                committed = seq.spec_accept_lengths[-1]
                self.spec_stats.record(verified.num_candidates, committed - 1)
            if committed is None or committed_at is None or verified.accepted_ranks is None:
                committed_at = None
                continue
            for b in smaller:  # the subtree of b nodes holds the accepted drafts of rank <= b
                kept = sum(rank <= b for rank in verified.accepted_ranks)
                committed_at[b] += min(1 + kept, committed)
            committed_at[budget] += committed
        return seqs, committed_at
