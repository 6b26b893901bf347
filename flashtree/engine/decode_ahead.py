"""A plain decode step queued before the step before it reads its tokens (overlap scheduling,
as vLLM's async scheduling and SGLang's overlap scheduler do it). A greedy decode batch's next
input tokens are its argmax, already on the device, and its next positions and slots are known
on the host, so the next forward can run while the host reads the tokens, appends them and
schedules. The next step takes it where it schedules exactly that batch again. Where it does
not, the queued forward wrote each request's next token's KV (the token the next real step
writes again: greedy) or into pages freed since, which every later owner's writes follow on the
stream; nothing it computed is read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtree.engine.scheduler import ScheduledChunk, Scheduler
from flashtree.kv.cache import PageTables
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode
from flashtree.runner.model_runner import ModelRunner


@dataclass
class QueuedDecode:
    """The decode forward of requests `seq_ids` at logical indices `starts`, queued on the
    device behind the argmax it takes its input tokens from."""

    seq_ids: list[int]
    starts: list[int]
    batch: ForwardBatch
    logits: torch.Tensor  # [R, vocab slice]
    features: torch.Tensor | None

    def answers(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this forward is the one `chunks` ask for: one decode token of each of the
        same requests, in the same order (the token: the argmax, greedy)."""
        if len(chunks) != len(self.seq_ids) or any(
                not c.decode or c.seq.seq_id != i for c, i in zip(chunks, self.seq_ids)):
            return False
        # A request's next decode index moves only by a step (a readmission prefills first).
        assert [c.start for c in chunks] == self.starts, (self.starts, chunks)
        return True


def queue_decode(runner: ModelRunner, pages: PageTables, scheduler: Scheduler,
                 chunks: list[ScheduledChunk], next_ids: torch.Tensor) -> QueuedDecode | None:
    """Queue the decode forward of a decode step's requests (`chunks`, whose KV the step has
    just written) one token on, its input tokens `next_ids` [R] the step's argmax on the device.
    None where the next step will likely be another batch (a request waiting with room to be
    admitted, a prompt still in chunks, a request at its length limit) or its pages are not
    free (the scheduler would preempt for them)."""
    seqs = [c.seq for c in chunks]
    admits = scheduler.waiting and len(scheduler.running) < scheduler.cfg.max_num_seqs
    if (admits or len(seqs) != len(scheduler.running)
            or any(s.num_computed + 1 >= s.max_total_len for s in seqs)):
        return None
    wanted = [(s.seq_id, s.num_computed + 1) for s in seqs]
    if sum(pages.pages_needed(i, n) for i, n in wanted) > pages.num_free:
        return None
    for seq_id, tokens in wanted:
        pages.reserve(seq_id, tokens)
    items = [BatchItem(s.seq_id, s.num_computed, [0]) for s in seqs]
    batch = ForwardBatch.build(Mode.DECODE, items, pages, runner.device)
    batch.input_ids = next_ids
    logits, features = runner.run(batch, gather_logits=False)
    return QueuedDecode([s.seq_id for s in seqs], [s.num_computed for s in seqs], batch,
                        logits, features)
