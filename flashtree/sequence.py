"""Per-request state as the scheduler and runner see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from flashtree.logprobs import TokenLogprobs
from flashtree.sampling import SamplingParams
from flashtree.structured_output import TokenMatcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # decides every sampled token (sampling.uniform) at temperature > 0
    generator: torch.Generator  # RRS draws (seeded with `seed`)
    max_total_len: int  # prompt + generated tokens may not exceed this
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    # Tokens of prompt_ids + output_ids whose KV is in the cache. Reset to 0 on preemption.
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    finish_reason: str | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    text: str = ""  # detokenized output, cut at a stop string when one matched
    spec_accept_lengths: list[int] = field(default_factory=list)
    matcher: TokenMatcher | None = None  # the grammar of a structured-output request
    # One entry per output token / prompt token (None for the first) when the params ask.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt tokens still need their log-probs (a forward over every row of
        the prompt, not the prefix cache)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def last_token(self) -> int:
        """The newest token: the root of a speculative step (the last prompt token when a
        chunked prefill left it for the first decode step)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
