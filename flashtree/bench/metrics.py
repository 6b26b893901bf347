"""Per-request timing records and the serving metrics computed from them (vLLM / SGLang
definitions: TTFT = send -> first token; TPOT = (E2E - TTFT) / (output tokens - 1) per request;
ITL = gaps between streamed chunks; throughputs over the wall time of the whole run)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    start: float  # when the request was sent (perf_counter seconds)
    prompt_tokens: int
    # (arrival time, tokens in that chunk) for every chunk of output, in order
    chunks: list[tuple[float, int]] = field(default_factory=list)
    end: float | None = None
    output_tokens: int | None = None  # set when known exactly (usage); else the chunk sum
    accept_lengths: list[int] = field(default_factory=list)  # tokens per target forward
    token_ids: list[int] = field(default_factory=list)  # the output (in-process runs)
    error: str | None = None

    @property
    def num_output(self) -> int:
        if self.output_tokens is not None:
            return self.output_tokens
        return sum(n for _, n in self.chunks)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.start

    @property
    def e2e(self) -> float:
        assert self.end is not None
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        n = self.num_output
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:])]


def _stats(prefix: str, values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {f"{k}_{prefix}": None for k in ("mean", "median", "std", "p99")}
    a = np.asarray(values) * scale
    return {f"mean_{prefix}": float(a.mean()), f"median_{prefix}": float(np.median(a)),
            f"std_{prefix}": float(a.std()), f"p99_{prefix}": float(np.percentile(a, 99))}


def accept_histogram(lengths: list[int]) -> dict[str, int]:
    """How many target forwards committed each number of tokens: {"1": n1, "2": n2, ...}."""
    counts = Counter(lengths)
    return {str(k): counts[k] for k in sorted(counts)}


def summarize(records: list[RequestRecord], duration: float,
              accept: tuple[float, dict[str, int]] | None = None) -> dict:
    """The metric row of one run. Acceptance comes from `accept` (mean, histogram: a server's
    counters) or else from the records' per-forward lengths; None when neither has any."""
    done = [r for r in records if r.ok]
    out_tokens = sum(r.num_output for r in done)
    lengths = [x for r in done for x in r.accept_lengths]
    if accept is None and lengths:
        accept = float(np.mean(lengths)), accept_histogram(lengths)
    row = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in done)) / duration,
        **_stats("ttft_ms", [r.ttft for r in done]),
        **_stats("tpot_ms", [t for r in done if (t := r.tpot) is not None]),
        **_stats("itl_ms", [x for r in done for x in r.itls]),
        **_stats("e2e_ms", [r.e2e for r in done]),
        "accept_length": accept[0] if accept else None,
        "accept_length_histogram": accept[1] if accept else {},
    }
    return row


def tau_mean(accepted: list[int]) -> dict[str, float | None]:
    """Tokens committed per request per speculative step: {"tau": mean (1 without any),
    "tau_se": its standard error, "tau_steps": how many steps}; steps are independent draws
    under the acceptance oracle."""
    n = len(accepted)
    mean = sum(accepted) / n if n else 1.0
    var = sum((a - mean) ** 2 for a in accepted) / (n - 1) if n > 1 else None
    return {"tau": mean, "tau_se": None if var is None else (var / n) ** 0.5, "tau_steps": n}


def tau_ratio(a: dict, b: dict) -> dict[str, float | None]:
    """a's tau over b's (`tau_mean` dicts) and its standard error (first order)."""
    ratio = a["tau"] / b["tau"]
    if a["tau_se"] is None or b["tau_se"] is None:
        return {"ratio": ratio, "se": None}
    return {"ratio": ratio, "se": ratio * ((a["tau_se"] / a["tau"]) ** 2
                                           + (b["tau_se"] / b["tau"]) ** 2) ** 0.5}
