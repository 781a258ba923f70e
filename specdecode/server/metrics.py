"""Prometheus metrics, in a registry owned by the app (no process-global registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdecode.engine.stats import GenerationStats


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specdecode_requests", "HTTP generation requests", ["endpoint", "status"],
                                registry=r)
        self.tokens = Counter("specdecode_tokens_generated", "tokens generated", registry=r)
        self.rounds = Counter("specdecode_rounds", "speculative rounds (target passes)", registry=r)
        self.drafted = Counter("specdecode_tokens_drafted", "draft tokens proposed", registry=r)
        self.accepted = Counter("specdecode_tokens_accepted", "draft tokens accepted", registry=r)
        self.accepted_at = Counter("specdecode_accepted_per_position", "draft tokens accepted at position",
                                   ["position"], registry=r)
        self.t_draft = Counter("specdecode_draft_seconds", "time spent drafting", registry=r)
        self.t_verify = Counter("specdecode_verify_seconds", "time spent verifying", registry=r)
        self.t_prefill = Counter("specdecode_prefill_seconds", "time spent on prompts (prefill)", registry=r)
        self.cached = Counter("specdecode_prompt_tokens_cached", "prompt tokens found in a cache, not computed",
                              registry=r)
        self.mean_acceptance = Gauge("specdecode_mean_acceptance_length",
                                     "tokens per round over all requests (bonus included)", registry=r)
        self.running = Gauge("specdecode_running_generations", "generations in progress", registry=r)
        self.isolated = Counter("specdecode_isolated_rounds", "shared rounds that failed and were rerun row "
                                "by row to end only the requests at fault", registry=r)
        self.queued = Gauge("specdecode_queued_requests", "requests waiting", registry=r)
        self.batch_size = Histogram("specdecode_batch_size", "sequences in a round (one target pass)",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.pass_tokens = Histogram("specdecode_pass_tokens", "tokens in a target pass (all sequences' rows)",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.ttft = Histogram("specdecode_time_to_first_token_seconds", "from submission to the first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        self.cancelled = Counter("specdecode_cancelled", "generations stopped by client disconnect", registry=r)

    def record(self, stats: GenerationStats) -> None:
        self.tokens.inc(stats.new_tokens)
        self.rounds.inc(stats.num_rounds)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        for i, n in enumerate(stats.accepted_per_position, start=1):
            self.accepted_at.labels(position=str(i)).inc(n)
        self.t_draft.inc(stats.t_draft)
        self.t_verify.inc(stats.t_verify)
        self.t_prefill.inc(stats.t_prefill)
        self.cached.inc(stats.cached_tokens)
        rounds = self.rounds._value.get()
        if rounds:
            self.mean_acceptance.set(self.tokens._value.get() / rounds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
