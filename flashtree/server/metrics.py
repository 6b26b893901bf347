"""Prometheus metrics with vLLM-style names (prefix `flashtree:`; the speculative counters also
under vLLM's own `vllm:` names, which dashboards built for vLLM read)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("flashtree:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("flashtree:time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("flashtree:e2e_request_latency_seconds", "End-to-end latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("flashtree:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("flashtree:generation_tokens", "Generated tokens",
                                         registry=r)
        self.requests = Counter("flashtree:request_success",
                                "Finished requests, by why: stop, length, abort (the client "
                                "left or the shutdown drain ran out) or error",
                                ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):  # each series exists from the start
            self.requests.labels(reason)
        self.running = Gauge("flashtree:num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("flashtree:num_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge("flashtree:kv_cache_usage_perc", "KV cache pages in use (0-1)",
                              registry=r)
        # Speculative totals: counters under flashtree's names and vLLM's, moved at each scrape
        # by what the engine's cumulative stats gained since the last one.
        self.drafts = _Totals(r, "spec_decode_num_drafts", "Speculative verify rounds")
        self.draft_tokens = _Totals(r, "spec_decode_num_draft_tokens",
                                    "Candidate tokens verified")
        self.accepted = _Totals(r, "spec_decode_num_accepted_tokens",
                                "Candidate tokens accepted")
        self.accepted_per_pos = _Totals(r, "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted candidates by depth", "position")
        self.budgets = _Totals(r, "spec_decode_budget_request_steps",
                               "Request-steps by the draft budget chosen (0: plain decoding)",
                               "budget", vllm=False)
        self.prefix_queries = _Totals(r, "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = _Totals(r, "prefix_cache_hits", "Prompt tokens found there")
        self.speculative_steps = _Totals(r, "spec_decode_speculative_steps",
                                         "Decode steps that drafted, by the step's number of "
                                         "requests", "batch", vllm=False)
        self.decode_overlap = _Totals(r, "decode_overlap_steps", "Decode forwards queued before "
                                      "the step before read its tokens: taken by the next "
                                      "step, or dropped (its GPU time wasted)", "outcome",
                                      vllm=False)

    def observe_finished(self, req, now: float) -> None:
        seq = req.seq
        self.e2e.observe(now - req.arrival)
        if req.first_token is not None:
            self.ttft.observe(req.first_token - req.arrival)
            if len(seq.output_ids) > 1:
                self.tpot.observe((now - req.first_token) / (len(seq.output_ids) - 1))
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.generation_tokens.inc(len(seq.output_ids))
        self.requests.labels(seq.finish_reason or "abort").inc()

    def refresh(self, engine) -> None:
        """Copy the engine's gauges and speculative counters just before a scrape."""
        sched, pages = engine.scheduler, engine.pages
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(1 - pages.num_free / pages.num_pages)
        self.decode_overlap.sync({"taken": engine.overlapped_decode_steps,
                                  "dropped": engine.dropped_decode_steps})
        if pages.prefix is not None:
            self.prefix_queries.sync({"": pages.prefix.queried_tokens})
            self.prefix_hits.sync({"": pages.prefix.hit_tokens})
        if engine.spec_stats is not None:
            stats = engine.spec_stats
            self.drafts.sync({"": stats.num_drafts})
            self.draft_tokens.sync({"": stats.num_draft_tokens})
            self.accepted.sync({"": stats.num_accepted_tokens})
            self.accepted_per_pos.sync({str(p): c for p, c in enumerate(stats.accepted_per_pos)})
            self.budgets.sync({str(b): c for b, c in stats.budgets.items()})
            self.speculative_steps.sync({str(b): c for b, c in stats.speculative_steps.items()})


class _Totals:
    """A Prometheus counter (`flashtree:NAME`, and `vllm:NAME` unless `vllm=False`) following a
    cumulative total kept elsewhere, optionally per value of one label."""

    def __init__(self, registry: CollectorRegistry, name: str, doc: str, label: str | None = None,
                 vllm: bool = True) -> None:
        labels = [label] if label else []
        self.counters = [Counter(f"{prefix}:{name}", doc, labels, registry=registry)
                         for prefix in (("flashtree", "vllm") if vllm else ("flashtree",))]
        self.seen: dict[str, float] = {}

    def sync(self, totals: dict[str, float]) -> None:
        """Move the counters up to `totals` (label value -> total; "" without a label)."""
        for key, total in totals.items():
            gained = total - self.seen.get(key, 0)
            if gained > 0:
                for counter in self.counters:
                    (counter.labels(key) if key else counter).inc(gained)
                self.seen[key] = total
