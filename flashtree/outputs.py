"""Result objects returned by LLM.generate / LLM.chat, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashtree.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # Tokens committed by each target forward after the prefill (plain decoding: all 1).
    spec_accept_lengths: list[int] = field(default_factory=list)
    # With SamplingParams.logprobs: per token, the chosen token's and the top alternatives'.
    logprobs: list[TokenLogprobs] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(entry[t].logprob for entry, t in zip(self.logprobs, self.token_ids))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With SamplingParams.prompt_logprobs: per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
