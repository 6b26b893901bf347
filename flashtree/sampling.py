"""SamplingParams (vLLM names and defaults) and the logits processing shared by plain and
speculative decoding: penalties, temperature, top-k, top-p, min-p, then a seeded draw."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from flashtree.transfer import to_device

_GUIDED_FIELDS = ("guided_json", "guided_json_object", "guided_regex", "guided_grammar",
                  "guided_choice")
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs limit)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # choices per prompt, each sampled on its own (`choice`)
    # Log-probabilities of each output token and of this many most likely alternatives
    # (`flashtree.logprobs`); of each prompt token after the first.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output (`flashtree.structured_output`), at most one of: a JSON schema (dict
    # or its text), any JSON object, a regex, a Lark (or GBNF) grammar, one of given strings.
    guided_json: dict | str | None = None
    guided_json_object: bool = False
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(self.temperature, "temperature", self.temperature >= 0, ">= 0")
        _check(self.top_p, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        _check(self.top_k, "top_k", self.top_k >= -1, "-1, 0 (off) or a positive integer")
        _check(self.min_p, "min_p", 0 <= self.min_p <= 1, "in [0, 1]")
        _check(self.repetition_penalty, "repetition_penalty", self.repetition_penalty > 0, "> 0")
        _check(self.presence_penalty, "presence_penalty", -2 <= self.presence_penalty <= 2,
               "in [-2, 2]")
        _check(self.frequency_penalty, "frequency_penalty", -2 <= self.frequency_penalty <= 2,
               "in [-2, 2]")
        if self.max_tokens is not None:
            _check(self.max_tokens, "max_tokens", self.max_tokens >= 1, ">= 1 (or None)",
                   integer=True)
        _check(self.n, "n", isinstance(self.n, int) and self.n >= 1, ">= 1", integer=True)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(value, name, 0 <= value <= MAX_LOGPROBS,
                       f"an integer in [0, {MAX_LOGPROBS}] or None", integer=True)
        guided = [f for f in _GUIDED_FIELDS if getattr(self, f) not in (None, False)]
        if len(guided) > 1:
            raise ValueError(f"give at most one structured-output field, got {guided}")
        if self.guided_choice is not None and not (
                self.guided_choice and all(isinstance(c, str) and c for c in self.guided_choice)):
            raise ValueError(f"guided_choice must be a non-empty list of non-empty strings, got "
                             f"{self.guided_choice!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        self.stop_strings = tuple(stops)
        ids = self.stop_token_ids or []
        if not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {ids!r}")
        self.stop_token_ids = list(ids)

    def choice(self, i: int) -> SamplingParams:
        """The parameters of choice i of n: one choice, seeded seed + i (so that a seeded
        request's choices are reproducible, and choice i equals a request seeded seed + i)."""
        seed = None if self.seed is None else self.seed + i
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def guided_field(self) -> str | None:
        """The structured-output field this request sets, if any."""
        return next((f for f in _GUIDED_FIELDS if getattr(self, f) not in (None, False)), None)

    @property
    def argmax_only(self) -> bool:
        """Greedy without penalties, and nothing else read from or applied to the logits (no
        log-probs, no grammar mask): the token is the argmax of the raw logits, which TP ranks
        reduce without gathering."""
        return (self.greedy and not self.has_penalties and self.logprobs is None
                and self.guided_field is None)


def _check(value, name: str, ok: bool, allowed: str, integer: bool = False) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if integer and not isinstance(value, int):
        is_number = False
    if not is_number or (isinstance(value, float) and math.isnan(value)) or not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """vLLM semantics: repetition over prompt + output, presence/frequency over output only.
    logits: [vocab] float32 -> [vocab]."""
    return penalize_rows(logits[None], params, prompt_ids, output_ids)[0]


def penalize_rows(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    extra_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Penalties for n rows that share the committed context and each add their own generated
    tokens (a tree node's path): logits [n, vocab]; extra_counts [n, vocab] -> [n, vocab]."""
    if not params.has_penalties:
        return logits
    vocab, device = logits.shape[-1], logits.device
    counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
    if output_ids:
        counts = torch.bincount(to_device(output_ids, device), minlength=vocab).to(logits.dtype)
    counts = counts.expand_as(logits)
    if extra_counts is not None:
        counts = counts + extra_counts.to(logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            in_prompt[to_device(prompt_ids, device)] = True
            seen = seen | in_prompt
        penalty = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty),
                             logits)
    if params.presence_penalty or params.frequency_penalty:
        logits = logits - (params.frequency_penalty * counts
                           + params.presence_penalty * (counts > 0).to(logits.dtype))
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution plain sampling draws from at temperature > 0.
    logits: [..., vocab] -> [..., vocab]."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) that decides output token `position` of a request seeded
    `seed`: a splitmix64 hash of the pair, so that a token's draw depends on nothing else (not
    on the batch, the step, or how many candidates speculation verified)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def inverse_cdf(probs: torch.Tensor, u: list[float]) -> torch.Tensor:
    """The token of each row whose cumulative probability interval holds u: an exact draw from
    the row's distribution when u is uniform. probs: [m, vocab] -> [m] int64."""
    cdf = probs.double().cumsum(-1)  # [m, vocab]
    target = to_device(u, probs.device, torch.float64)[:, None] * cdf[:, -1:]
    picks = torch.searchsorted(cdf, target, right=True)[:, 0]  # first index with cdf > target
    # Rounding can put the target at the very end; never return a zero-probability token.
    vocab_ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, vocab_ids, 0).amax(-1)
    return torch.minimum(picks, last)


@dataclass(frozen=True)
class SamplingRow:
    """What drawing one request's next token reads besides its logits row."""

    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]


def sample_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Draw the next token of every row with one device-to-host copy for the batch. Rows that
    share their sampling parameters are processed together; each row's draw is
    `uniform(seed, output position)`, so a seeded request gets the same tokens in any batch.
    logits: [m, vocab] float32 with len(rows) == m."""
    assert logits.shape[0] == len(rows), f"{logits.shape[0]} logits rows for {len(rows)} rows"
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if penalized:
        logits = logits.clone()
        for i in penalized:
            r = rows[i]
            logits[i] = apply_penalties(logits[i], r.params, r.prompt_ids, r.output_ids)
    picks = logits.argmax(-1)  # [m]; the answer for greedy rows
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        if not r.params.greedy:
            p = r.params
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
    for members in groups.values():
        index = to_device(members, logits.device)
        probs = probabilities(logits[index], rows[members[0]].params)  # [len(members), vocab]
        u = [uniform(rows[i].seed, len(rows[i].output_ids)) for i in members]
        picks[index] = inverse_cdf(probs, u)
    return picks.tolist()
