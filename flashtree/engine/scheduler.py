"""Continuous batching: admits waiting sequences by free KV pages, prefills long prompts in
chunks, decodes every running sequence together (in the same step as prompt chunks where the
engine allows: a mixed step), and preempts (recompute) when pages run out."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from flashtree.config import SchedulerConfig
from flashtree.kv.cache import PageTables
from flashtree.sequence import SeqStatus, Sequence


@dataclass
class ScheduledChunk:
    """Compute tokens [start, start + count) of `seq`; sample a token when the chunk ends at the
    sequence's last token."""

    seq: Sequence
    start: int
    count: int
    decode: bool = False  # one new token of a running request (speculation may extend it)

    @property
    def samples(self) -> bool:
        return self.start + self.count == self.seq.num_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pages: PageTables) -> None:
        self.cfg = cfg
        self.pages = pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is preempted first
        self.num_preemptions = 0
        # Whether a step of (prompt chunks, decode tokens, longest prompt chunk) may run as
        # one forward; the engine narrows it where its graphs would not hold the mixed batch.
        self.mixes: Callable[[int, int, int], bool] = _always

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """Pick the work of the next forward: one decode token for every running sequence
        whose prompt is computed, and prefill chunks of the others and of waiting sequences
        that fit. Both go in one step where `mixes` allows (the decode tokens first: see
        `step_kind`), else the prompt chunks run alone and the decode tokens next. A mixed
        step admits requests at no cost of a step to the running ones: where requests end at
        different steps (speculation makes them), each admission would stall the batch for a
        prompt step of its own."""
        for seq in self.running:  # their newly computed full pages, for later requests
            self.pages.cache_computed(seq.seq_id, seq.token_slice, seq.num_computed)
        decode = self._schedule_decode()  # first: the running requests' pages come first
        prompt = self._schedule_prefill()
        if not prompt:
            return decode
        if decode and self.mixes(len(prompt), len(decode), max(c.count for c in prompt)):
            return decode + prompt
        return prompt

    def _schedule_prefill(self) -> list[ScheduledChunk]:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is SeqStatus.RUNNING and seq.num_uncomputed > 1:
                chunk = self._prefill_chunk(seq, budget)
                if chunk is not None:
                    chunks.append(chunk)
                    budget -= chunk.count
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            # (a readmitted sequence recomputes its outputs too; a new one is its prompt)
            tokens = seq.token_slice(0, seq.num_tokens) if seq.output_ids else seq.prompt_ids
            # Prompt log-probs need every prompt row's logits: no cached prefix for them.
            shares = not seq.wants_prompt_logprobs
            prefix = self.pages.cached_prefix(tokens) if shares else []
            if shares and self._prefix_in_flight(tokens, len(prefix)):
                continue  # admitted once those pages are computed, to share them
            # Admit only when the whole remaining prompt fits in free pages, so that admitted
            # sequences rarely need to preempt each other.
            if self.pages.pages_needed_after(prefix, seq.num_tokens) > self.pages.num_free:
                break
            self.waiting.remove(seq)
            seq.num_computed = self.pages.attach_prefix(seq.seq_id, prefix, seq.num_tokens)
            if not seq.output_ids:  # a first admission (a readmission recomputes outputs)
                seq.num_cached_tokens = seq.num_computed
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunk = self._prefill_chunk(seq, budget)
            assert chunk is not None, f"admitted sequence {seq.seq_id} could not be scheduled"
            chunks.append(chunk)
            budget -= chunk.count
        return chunks

    def _prefix_in_flight(self, tokens: list[int], cached_pages: int) -> bool:
        """Whether a running sequence is still computing full pages that `tokens` would find
        cached once computed, beyond the `cached_pages` found now (requests that arrive
        together with one system prompt, the n choices of one request)."""
        if self.pages.prefix is None:
            return False
        p = self.pages.page_size
        wanted = (len(tokens) - 1) // p  # pages a new sequence may take from the cache
        for other in self.running:
            if other.num_computed // p >= wanted or other.num_uncomputed <= 1:
                continue  # its pages are cached already, or it computes none
            # Page by page, so that an unrelated prompt costs one page's comparison.
            full = min(wanted, other.num_tokens // p)
            shared = 0
            while shared < full and (other.token_slice(shared * p, (shared + 1) * p)
                                     == tokens[shared * p:(shared + 1) * p]):
                shared += 1
            if shared > cached_pages and shared > other.num_computed // p:
                return True
        return False

    def _prefill_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        count = min(seq.num_uncomputed, budget)
        if not self._reserve(seq, seq.num_computed + count):
            return None
        return ScheduledChunk(seq, seq.num_computed, count)

    def _schedule_decode(self) -> list[ScheduledChunk]:
        chunks = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted by an earlier sequence of this loop
            if seq.num_uncomputed > 1:
                continue  # its prompt is still being prefilled in chunks
            if self._reserve(seq, seq.num_tokens):
                chunks.append(ScheduledChunk(seq, seq.num_computed, 1, decode=True))
        return chunks

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Reserve pages for `num_tokens` tokens of `seq`, preempting the most recently admitted
        other sequences if needed. Returns False if `seq` itself had to be preempted."""
        while self.pages.pages_needed(seq.seq_id, num_tokens) > self.pages.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.pages.reserve(seq.seq_id, num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV; it is recomputed from its tokens when readmitted (from the
        prefix cache, as far as its pages are still there)."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Free the sequence's pages, its computed full pages cached first."""
        self.pages.cache_computed(seq.seq_id, seq.token_slice, seq.num_computed)
        self.pages.free(seq.seq_id)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, "abort")


def step_kind(chunks: list[ScheduledChunk]) -> str:
    """"decode" (one token of every chunk's request), "prompt" (prompt chunks alone) or
    "mixed" (both), of a step `Scheduler.schedule` made: its decode tokens come first, so the
    first and last chunks tell without a scan."""
    if chunks[-1].decode:
        return "decode"
    return "mixed" if chunks[0].decode else "prompt"


def _always(prompt_chunks: int, decode_tokens: int, longest_chunk: int) -> bool:
    return True
