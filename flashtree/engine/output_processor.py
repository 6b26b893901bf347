"""What happens to a step's tokens once they are drawn: appended to their request until one
finishes it (EOS, stop token ids, stop strings, a grammar's end, the length), counted in the
acceptance lengths, their log-probs and the prompt's recorded, and the text detokenized. An
error while doing so fails that request only."""

from __future__ import annotations

import contextlib

import torch

from flashtree.engine.scheduler import ScheduledChunk, Scheduler
from flashtree.logprobs import output_logprobs, prompt_logprobs
from flashtree.sequence import Sequence
from flashtree.tokenizer import Tokenizer
from flashtree.transfer import to_device


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer | None,
                 eos_token_ids: frozenset[int]) -> None:
        self.scheduler, self.tokenizer, self.eos_token_ids = scheduler, tokenizer, eos_token_ids

    @contextlib.contextmanager
    def isolated(self, seq: Sequence):
        """An exception while finishing one request's step fails that request only."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - reported on the request, the batch goes on
            seq.error = f"{type(e).__name__}: {e}"
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")

    def append(self, seq: Sequence, tokens: list[int], record: bool,
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

    def record_prompt_logprobs(self, chunks: list[ScheduledChunk], scores_prompt: list[bool],
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
                    with self.isolated(seq):
                        seq.prompt_logprobs += prompt_logprobs(
                            logits[row + have - first : row + end - first],
                            seq.prompt_ids[have:end], seq.params.prompt_logprobs)
            if c.samples:
                sample_rows.append(row + rows - 1)
            row += rows
        return logits[to_device(sample_rows, logits.device)]

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
