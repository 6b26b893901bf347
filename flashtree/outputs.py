"""Result objects returned by LLM.generate / LLM.chat, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # Tokens committed by each target forward after the prefill (plain decoding: all 1).
    spec_accept_lengths: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
