"""An oracle for flashtree's logits processing that shares none of its code: transformers' logits
processors, and OpenAI's presence/frequency formula (transformers has no processor for them),
composed as flashtree documents (`flashtree/sampling.py`, `docs/api.md`). One row at a time."""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from flashtree.sampling import SamplingParams


def penalize(logits: torch.Tensor, history: torch.Tensor, outputs: torch.Tensor, params
             ) -> torch.Tensor:
    """vLLM's order and scope: the repetition penalty over prompt + output tokens
    (transformers' processor, given both as its input_ids), then OpenAI's
    `logit - frequency_penalty * count - presence_penalty * (count > 0)` over output tokens.
    logits [B, V]; history [B, prompt + output] and outputs [B, output] int64 -> [B, V]."""
    if params.repetition_penalty != 1.0 and history.shape[1]:
        logits = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(history,
                                                                                    logits)
    counts = torch.zeros_like(logits).scatter_add_(1, outputs, torch.ones_like(outputs).to(logits))
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def warpers(params) -> LogitsProcessorList:
    """transformers' temperature, top-k, top-p and min-p warpers, in flashtree's (and vLLM's)
    order."""
    found = LogitsProcessorList([TemperatureLogitsWarper(float(params.temperature))])
    if 0 < params.top_k:
        found.append(TopKLogitsWarper(params.top_k))  # it keeps min(top_k, vocab)
    if params.top_p < 1.0:
        found.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        found.append(MinPLogitsWarper(params.min_p))
    return found


def penalized_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                     output_ids: list[int]) -> torch.Tensor:
    """One row: [vocab] -> [vocab] float32, `penalize`d."""
    history = torch.tensor([list(prompt_ids) + list(output_ids)], dtype=torch.long)
    outputs = torch.tensor([list(output_ids)], dtype=torch.long).view(1, len(output_ids))
    return penalize(logits.float()[None].clone(), history, outputs, params)[0]


def sampling_probs(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                   output_ids: list[int]) -> torch.Tensor:
    """The distribution a token is drawn from at temperature > 0: the penalized logits through
    the `warpers`, then softmax."""
    row = penalized_logits(logits, params, prompt_ids, output_ids)[None]
    no_ids = torch.zeros(1, 0, dtype=torch.long)  # the warpers read only the scores
    return torch.softmax(warpers(params)(no_ids, row), dim=-1)[0]


def output_logprobs(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """[vocab] log-probabilities flashtree reports for an output token (docs/api.md): of the
    penalized logits divided by the temperature (temperature 0: undivided), with no top-k,
    top-p or min-p truncation."""
    row = penalized_logits(logits, params, prompt_ids, output_ids)[None]
    if not params.greedy:
        row = TemperatureLogitsWarper(float(params.temperature))(None, row)
    return torch.log_softmax(row, dim=-1)[0]
