"""Prometheus metrics with vLLM-style names (prefix `flashtree:`)."""

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
        self.requests = Counter("flashtree:request_success", "Finished requests",
                                ["finished_reason"], registry=r)
        self.running = Gauge("flashtree:num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("flashtree:num_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge("flashtree:kv_cache_usage_perc", "KV cache pages in use (0-1)",
                              registry=r)
        self.drafts = Gauge("flashtree:spec_decode_num_drafts", "Speculative verify rounds",
                            registry=r)
        self.draft_tokens = Gauge("flashtree:spec_decode_num_draft_tokens",
                                  "Candidate tokens verified", registry=r)
        self.accepted = Gauge("flashtree:spec_decode_num_accepted_tokens",
                              "Candidate tokens accepted", registry=r)
        self.accepted_per_pos = Gauge("flashtree:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted candidates by depth", ["position"], registry=r)
        self.budgets = Gauge("flashtree:spec_decode_budget_request_steps",
                             "Request-steps by the draft budget chosen (0: plain decoding)",
                             ["budget"], registry=r)
        self.speculative_steps = Gauge("flashtree:spec_decode_speculative_steps",
                                       "Decode steps that drafted, by the step's number of "
                                       "requests", ["batch"], registry=r)

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
        if engine.speculative is not None:
            stats = engine.speculative.stats
            self.drafts.set(stats.num_drafts)
            self.draft_tokens.set(stats.num_draft_tokens)
            self.accepted.set(stats.num_accepted_tokens)
            for pos, count in enumerate(stats.accepted_per_pos):
                self.accepted_per_pos.labels(str(pos)).set(count)
            for budget, count in stats.budgets.items():
                self.budgets.labels(str(budget)).set(count)
            for batch, count in stats.speculative_steps.items():
                self.speculative_steps.labels(str(batch)).set(count)
