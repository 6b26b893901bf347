"""Synchronous engine: owns the model, KV cache, scheduler and runner; `step()` runs one
scheduled forward (plain or speculative) and returns the sequences that got new tokens."""

from __future__ import annotations

import contextlib
import itertools
import time

import torch

from flashtree.config import EngineConfig, ModelConfig, SpecConfig
from flashtree.distributed import tp_min
from flashtree.distributed.vocab import vocab_argmax
from flashtree.engine.scheduler import ScheduledChunk, Scheduler, step_kind
from flashtree.graphs.runner import batch_buckets
from flashtree.graphs.schema import GraphDims, GraphMode
from flashtree.kv.cache import KVCache, PageTables
from flashtree.logprobs import output_logprobs, prompt_logprobs
from flashtree.models.dflash import DFlashDraftModel
from flashtree.models.llama import DecoderModel
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.runner.model_runner import ModelRunner
from flashtree.sampling import SamplingParams, SamplingRow, sample_tokens
from flashtree.sequence import Sequence
from flashtree.speculative.decoder import SpeculativeDecoder
from flashtree.speculative.policy import AdaptivePolicy, FixedPolicy, SpecPolicy, StepResult
from flashtree.speculative.proposer import ContextRows, DFlashProposer
from flashtree.structured_output import GrammarCompiler, mask_by_grammar
from flashtree.tokenizer import Tokenizer
from flashtree.transfer import to_device

# Largest captured forward in token rows (beyond max_num_seqs decode rows): bigger verify
# batches run eagerly, where launch overhead is small next to the work.
_GRAPH_MAX_ROWS = 8192
# Prompt chunks replay graphs of these tokens per request, up to _PREFILL_MAX_ROWS rows: an
# eager prefill of a short prompt costs about ten decode steps in kernel launches, and wherever
# requests finish at different steps (speculation makes them), each admission is one.
_PREFILL_TOKENS = (32, 64, 128, 256)
_PREFILL_MAX_ROWS = 2048


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
        bytes_per_token = model_cfg.num_layers * kv_heads * (k_dim + v_dim)
        if drafter is not None:
            d = drafter.layers[0].self_attn
            bytes_per_token += 2 * len(drafter.layers) * d.num_kv_heads * d.head_dim
        # Every TP rank must schedule alike: all take the smallest rank's page count.
        num_pages = tp_min(args.cache.resolve_num_pages(
            args.scheduler.max_num_seqs, args.scheduler.max_model_len,
            bytes_per_token * args.dtype.itemsize, args.device,
        ), args.device)
        # One page more than the page tables hand out: its first slot takes the K/V of a
        # captured graph's padded tokens.
        self.cache = KVCache(
            model_cfg.num_layers, num_pages + 1, args.cache.page_size, kv_heads, k_dim,
            args.dtype, args.device, v_head_dim=v_dim,
        )
        self.pages = PageTables(num_pages, args.cache.page_size, args.cache.prefix_caching)
        self.proposer: DFlashProposer | None = None
        self.speculative: SpeculativeDecoder | None = None
        self.policy: SpecPolicy | None = None
        spec = args.spec
        self.lookahead = 0 if spec is None else spec.lookahead
        if drafter is not None:
            drafter.cfg.check_target(model_cfg)
            self.proposer = DFlashProposer(drafter, model, self.pages, args.dtype, args.device)
            self.pages.before_release = self.proposer.flush
        self.scheduler = Scheduler(args.scheduler, self.pages)
        self.runner = ModelRunner(model, self.cache, self.pages,
                                  drafter.cfg.target_layer_ids if drafter is not None else ())
        if self.uses_cuda_graphs:
            self._capture_graphs(spec)
            self.scheduler.mixes = self._mixes_in_graphs
        if spec is not None:
            assert self.proposer is not None
            self.speculative = SpeculativeDecoder(spec, self.proposer, self.runner, self.cache,
                                                  self.pages)
            self.policy = (AdaptivePolicy(spec.max_budget) if spec.policy == "adaptive"
                           else FixedPolicy(spec.max_budget))
        self._ids = itertools.count()
        eos = set(model_cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._grammars: GrammarCompiler | None = None  # built for the first guided request

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode, short prompt chunks, draft and verify replay CUDA graphs on CUDA, unless
        `enforce_eager`; under tensor parallelism every rank captures the same graphs, with
        their collectives inside, and replays them in the same order."""
        return self.args.device.type == "cuda" and not self.args.enforce_eager

    def _capture_graphs(self, spec: SpecConfig | None) -> None:
        """Capture decode (1 token per request), short prompt chunks and, with a drafter, the
        draft block and the verify shape (a chain or a tree of budget + 1 tokens), for batch
        buckets up to max_num_seqs."""
        page = self.args.cache.page_size
        longest = self.args.scheduler.max_model_len + self.lookahead
        dims = GraphDims(max_pages=-(-longest // page) + 1, scratch_slot=self.pages.scratch_slot)
        buckets = batch_buckets(self.args.scheduler.max_num_seqs)
        max_rows = max(_GRAPH_MAX_ROWS, self.args.scheduler.max_num_seqs)
        shapes = [(GraphMode.DECODE, 1, max_rows)]
        shapes += [(GraphMode.PREFILL, t, _PREFILL_MAX_ROWS) for t in _PREFILL_TOKENS]
        if spec is not None:
            mode = GraphMode.VERIFY_TREE if spec.method == "ddtree" else GraphMode.VERIFY_CHAIN
            shapes.append((mode, spec.max_budget + 1, max_rows))
            assert self.proposer is not None
            self.proposer.capture_graphs(dims, buckets, spec.block_size, max_rows)
        self.runner.capture_graphs(
            dims, buckets, shapes,
            context_writer=None if self.proposer is None else self.proposer.write_context)

    def _mixes_in_graphs(self, prompt_chunks: int, decode_tokens: int, longest_chunk: int
                         ) -> bool:
        """A mixed step replays a prompt graph whose every row is padded to the longest
        chunk: it runs unless the prompt chunks alone would replay one and the mixed batch
        would not (run eagerly, a prompt step costs about ten decode steps in launches)."""
        graphs = self.runner.graphs
        assert graphs is not None
        return (graphs.bucket(GraphMode.PREFILL, prompt_chunks + decode_tokens, longest_chunk)
                is not None
                or graphs.bucket(GraphMode.PREFILL, prompt_chunks, longest_chunk) is None)

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
                                             self.eos_token_ids)
        return self._grammars

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.abort(seq)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Sequence]:
        """Run one forward; return the sequences that got new tokens."""
        start = time.perf_counter()  # the policy times whole steps, scheduling included
        chunks = self.scheduler.schedule()
        if not chunks:
            assert not self.scheduler.running, "running sequences but nothing scheduled"
            raise RuntimeError("no request fits in the KV cache; lower max_tokens or the prompt")
        kind = step_kind(chunks)
        if self.speculative is None or kind != "decode":
            if self.speculative is not None and kind == "mixed":  # plain for the decoding
                self.speculative.stats.record_budget(0, sum(c.decode for c in chunks))
            return self._plain_step(chunks)
        outputs_before = sum(len(c.seq.output_ids) for c in chunks)
        assert self.policy is not None
        speculate = self.policy.plan(len(chunks)) > 0 and self._reserve_lookahead(chunks)
        if speculate:
            self.speculative.stats.record_speculative_step(len(chunks))
            done = self._speculative_step(chunks)
        else:
            self.speculative.stats.record_budget(0, len(chunks))
            done = self._plain_step(chunks)
        committed = sum(len(c.seq.output_ids) for c in chunks) - outputs_before
        self.policy.observe(StepResult(speculate, len(chunks), committed,
                                       time.perf_counter() - start))
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

    def _plain_step(self, chunks: list[ScheduledChunk]) -> list[Sequence]:
        """Prompt chunks, one plain decode token per request, or both (a mixed step, run as
        a prompt batch). With a drafter, the new tokens' context features go to the draft KV
        cache before the next draft: the first token of a prompt does not wait for them, nor
        does a plain step the policy chose (a decode or prompt graph writes them itself, and
        returns none)."""
        mode = Mode.DECODE if step_kind(chunks) == "decode" else Mode.PREFILL
        # Chunks of prompts whose log-probs are asked score every row, the others their last
        # row where they sample.
        scores_prompt = [not c.decode and c.seq.wants_prompt_logprobs for c in chunks]
        items = [
            BatchItem(c.seq.seq_id, c.start, c.seq.token_slice(c.start, c.start + c.count),
                      all_logits=every, wants_logits=c.samples or every)
            for c, every in zip(chunks, scores_prompt)
        ]
        sampling = [c for c in chunks if c.samples]
        # All-greedy batches take the argmax over TP vocab slices without gathering logits.
        all_greedy = (all(c.seq.params.argmax_only for c in sampling)
                      and not any(scores_prompt))
        logits, features = self.runner.forward(mode, items, gather_logits=not all_greedy)
        if any(scores_prompt):
            logits = self._record_prompt_logprobs(chunks, scores_prompt, logits)
        for c in chunks:
            c.seq.num_computed = c.start + c.count
            self.pages.set_length(c.seq.seq_id, c.seq.num_computed)
        if self.proposer is not None and features is not None:
            # The rows' positions and slots are the target batch's (the caches share pages).
            batch = self.runner.last_batch
            leases = self.pages.leases([c.seq.seq_id for c in chunks])
            assert None not in leases, "a chunk's request holds no pages (its forward wrote them)"
            self.proposer.defer(ContextRows(
                features, positions=batch.positions, slots=batch.attn.slot_mapping,
                leases=leases, counts=None if mode == Mode.DECODE else tuple(
                    c.count for c in chunks)))
        if any(c.seq.matcher is not None for c in sampling):
            logits = mask_by_grammar(logits, [(c.seq.matcher, [c.seq.last_token], [0])
                                              for c in sampling])
        if not sampling:
            tokens = []
        elif all_greedy:  # one device sync for the batch
            tokens = vocab_argmax(logits, self.runner.model.lm_head.vocab_start).tolist()
        else:
            tokens = self._sample(logits, sampling)
        for i, (c, token) in enumerate(zip(sampling, tokens)):
            if token is not None:
                with self._isolated(c.seq):
                    self._append(c.seq, [token], record=c.decode, logits=logits[i : i + 1])
        return [c.seq for c in sampling]

    def _record_prompt_logprobs(self, chunks: list[ScheduledChunk], scores_prompt: list[bool],
                                logits: torch.Tensor) -> torch.Tensor:
        """Append the prompt log-probs that chunks scoring every row computed; return the
        sampling chunks' rows (each chunk's last row, where it samples)."""
        sample_rows, row = [], 0
        for c, every in zip(chunks, scores_prompt):
            rows = c.count if every else int(c.samples)
            if every:
                seq, first = c.seq, c.start + 1  # row j scores the token at c.start + j + 1
                have = len(seq.prompt_logprobs)
                end = min(c.start + c.count + 1, len(seq.prompt_ids))
                assert have >= first, f"request {seq.seq_id}: prompt log-probs skip {have}.."
                if end > have:
                    with self._isolated(seq):
                        seq.prompt_logprobs += prompt_logprobs(
                            logits[row + have - first : row + end - first],
                            seq.prompt_ids[have:end], seq.params.prompt_logprobs)
            if c.samples:
                sample_rows.append(row + rows - 1)
            row += rows
        return logits[to_device(sample_rows, logits.device)]

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
                with self._isolated(c.seq):
                    tokens[-1] = sample_tokens(logits[i : i + 1], rows[i : i + 1])[0]
            return tokens

    @contextlib.contextmanager
    def _isolated(self, seq: Sequence):
        """An exception while finishing one request's step fails that request only."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - reported on the request, the batch goes on
            seq.error = f"{type(e).__name__}: {e}"
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")

    def _speculative_step(self, chunks: list[ScheduledChunk]) -> list[Sequence]:
        assert self.speculative is not None
        seqs = [c.seq for c in chunks]
        for seq, verified in zip(seqs, self.speculative.step(seqs)):
            with self._isolated(seq):
                self._append(seq, verified.tokens, record=True, logits=verified.logits)
                # Counted after stop conditions, so the counters match the returned tokens.
                committed = seq.spec_accept_lengths[-1]
                self.speculative.stats.record(verified.num_candidates, committed - 1)
        return seqs

    # ------------------------------------------------------------------ finishing
    def _append(self, seq: Sequence, tokens: list[int], record: bool,
                logits: torch.Tensor | None) -> None:
        """Append tokens one by one, stopping at the first that finishes the request.
        `record`: count them as one target forward's commit in spec_accept_lengths.
        `logits`: the rows that decided the tokens [len(tokens), vocab], for log-probs."""
        before, produced = len(seq.output_ids), 0
        for token in tokens:
            seq.output_ids.append(token)
            produced += 1
            if seq.matcher is not None:
                seq.matcher.accept(token)
            if self._check_finished(seq):
                break
        if record:
            seq.spec_accept_lengths.append(produced)
        if seq.params.logprobs is not None:
            assert logits is not None, f"request {seq.seq_id} asked for log-probs: no logits"
            seq.logprobs += output_logprobs(logits[:produced], seq.params, seq.prompt_ids,
                                            seq.output_ids[:before], tokens[:produced])

    def _check_finished(self, seq: Sequence) -> bool:
        params, token = seq.params, seq.output_ids[-1]
        if params.stop_strings and self.tokenizer is not None:
            text = self.decode(seq)
            hits = [i for i in (text.find(s) for s in params.stop_strings) if i >= 0]
            if hits:
                self.scheduler.finish(seq, "stop")
                seq.text = text[: min(hits)]
                return True
        grammar_ended = seq.matcher is not None and seq.matcher.ended
        if (not params.ignore_eos and token in self.eos_token_ids) or (
            token in params.stop_token_ids
        ) or grammar_ended:
            self.scheduler.finish(seq, "stop")
        elif seq.num_tokens >= seq.max_total_len:
            self.scheduler.finish(seq, "length")
        if seq.is_finished and self.tokenizer is not None:
            seq.text = self.decode(seq)
        return seq.is_finished

    def stream_text(self, seq: Sequence) -> str:
        """The part of the output text that is final: all of it once finished; before that,
        without a trailing incomplete UTF-8 character or a possible stop-string prefix."""
        if seq.is_finished:
            return seq.text
        text = self.decode(seq).rstrip("\ufffd")
        hold = max((len(s) - 1 for s in seq.params.stop_strings), default=0)
        return text[: len(text) - hold] if hold else text

    def decode(self, seq: Sequence) -> str:
        """The output text, without the end-of-sequence token that stopped it (which
        skip_special_tokens=False would spell out)."""
        assert self.tokenizer is not None, "decode needs a tokenizer"
        ids = seq.output_ids
        if seq.finish_reason == "stop" and ids and (
                ids[-1] in self.eos_token_ids or ids[-1] in seq.params.stop_token_ids):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, seq.params.skip_special_tokens)

