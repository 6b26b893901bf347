"""A plain decode step queued before the step before it reads its tokens (overlap scheduling,
as vLLM's async scheduling and SGLang's overlap scheduler do it). A greedy batch's next input
tokens are its argmax, already on the device, and its next positions and slots are known on
the host, so the next forward can run while the host reads the tokens, appends them and
schedules. The next step takes it where it decodes those requests again, or the part of them
that goes on (each row of a decode forward depends on its own request alone), a mixed step then
running its prompt chunks alone. Where it does not, the queued forward wrote each request's
next token's KV (the token the next real step writes again: greedy) or into pages freed since,
which every later owner's writes follow on the stream; nothing it computed is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashtree.engine.scheduler import ScheduledChunk, Scheduler
from flashtree.kv.cache import PageTables
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode
from flashtree.runner.model_runner import ModelRunner
from flashtree.transfer import to_device


@dataclass
class QueuedDecode:
    """The decode forward of requests `seq_ids` at logical indices `starts`, queued on the
    device behind the argmax it takes its input tokens from."""

    seq_ids: list[int]
    starts: list[int]
    batch: ForwardBatch
    logits: torch.Tensor  # [R, vocab slice]
    features: torch.Tensor | None
    taken: bool = False

    def rows_for(self, chunks: list[ScheduledChunk]) -> list[int] | None:
        """This forward's rows that answer `chunks`: one decode token of each of the requests
        it holds, in its order (those that ended since left out; the token: the argmax,
        greedy); None where `chunks` ask for anything else."""
        row_of = {seq_id: i for i, seq_id in enumerate(self.seq_ids)}
        rows = [row_of.get(c.seq.seq_id, -1) if c.decode else -1 for c in chunks]
        if -1 in rows or rows != sorted(rows):
            return None
        # A request's next decode index moves only by a step (a readmission prefills first).
        assert [c.start for c in chunks] == [self.starts[r] for r in rows], (self.starts, chunks)
        return rows

    def take(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                torch.Tensor]:
        """(logits, features, positions, KV slots) of `rows`."""
        self.taken = True
        batch = self.batch
        tensors = (self.logits, self.features, batch.positions, batch.attn.slot_mapping)
        if rows == list(range(len(self.seq_ids))):
            return tensors
        index = to_device(rows, self.logits.device)
        return tuple(None if t is None else t.index_select(0, index) for t in tensors)


def queue_decode(runner: ModelRunner, pages: PageTables, scheduler: Scheduler,
                 chunks: list[ScheduledChunk], next_ids: torch.Tensor,
                 plain_next: Callable[[int], bool]) -> QueuedDecode | None:
    """Queue the decode forward of the requests a step sampled a token for (`chunks`, whose
    KV the step has just written) one token on, its input tokens the step's argmax `next_ids`
    [R] on the device, but for requests at their length limit. None where the next step will
    likely not decode them: a prompt still in chunks, an admission that runs as a prompt step
    of its own (`scheduler.mixes`), not `plain_next(requests)`; where every request ends; or
    where the pages are not free (the scheduler would preempt)."""
    going_on = [i for i, c in enumerate(chunks) if c.seq.num_computed + 1 < c.seq.max_total_len]
    if len(chunks) != len(scheduler.running) or (
            scheduler.waiting and len(going_on) < scheduler.cfg.max_num_seqs
            and not scheduler.mixes(1, len(going_on), min(
                scheduler.waiting[0].num_tokens, scheduler.cfg.max_num_batched_tokens))):
        return None
    seqs = [chunks[i].seq for i in going_on]
    wanted = [(s.seq_id, s.num_computed + 1) for s in seqs]
    if (not seqs or not plain_next(len(seqs))
            or sum(pages.pages_needed(i, n) for i, n in wanted) > pages.num_free):
        return None
    for seq_id, tokens in wanted:
        pages.reserve(seq_id, tokens)
    items = [BatchItem(s.seq_id, s.num_computed, [0]) for s in seqs]
    batch = ForwardBatch.build(Mode.DECODE, items, pages, runner.device)
    batch.input_ids = (next_ids if len(seqs) == len(chunks)
                       else next_ids.index_select(0, to_device(going_on, next_ids.device)))
    logits, features = runner.run(batch, gather_logits=False)
    return QueuedDecode([s.seq_id for s in seqs], [s.num_computed for s in seqs], batch,
                        logits, features)
