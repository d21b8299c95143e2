"""Prometheus metrics of the server (names prefixed `sgrec:`), fed by the tokenizer manager."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sgrec.managers.generate import ReqState
from sgrec.managers.io_struct import ReqOutput, SchedulerStats

TIER_COUNTERS = ("hits", "misses", "writes", "bytes_written", "bytes_read", "failures", "evictions")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)

        def gauge(name, doc):
            return Gauge(f"sgrec:{name}", doc, names, registry=self.registry).labels(**self.labels)

        def counter(name, doc):
            return Counter(f"sgrec:{name}", doc, names, registry=self.registry).labels(**self.labels)

        def histogram(name, doc):
            return Histogram(f"sgrec:{name}", doc, names, buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(**self.labels)

        self.num_running_reqs = gauge("num_running_reqs", "Requests running (prefill or decode), all ranks.")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting in the schedulers' queues.")
        self.token_usage = gauge("token_usage", "Used share of the KV pool, cached prefixes included.")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the prefix cache / all prompt tokens.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_requests = counter("num_requests", "Finished requests.")
        self.num_aborted_requests = counter("num_aborted_requests", "Requests that ended with an abort.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self.hicache = Gauge("sgrec:hicache", "The KV tiers below the pool (--enable-hierarchical-cache), all ranks: "
                             "per tier (host, storage), pages hit and missed on lookup, pages and bytes written and "
                             "read, failures (storage errors, missing or corrupt objects), evictions.",
                             [*names, "tier", "counter"], registry=self.registry)
        self.hicache_loaded = Gauge("sgrec:hicache_loaded_tokens", "Tokens loaded back into the KV pool from a "
                                    "lower tier instead of recomputed, by tier.", [*names, "tier"], registry=self.registry)
        self._prompt_total = 0
        self._cached_total = 0

    def on_stats(self, stats: dict[int, SchedulerStats]) -> None:
        ranks = list(stats.values())
        self.num_running_reqs.set(sum(s.num_running_reqs for s in ranks))
        self.num_queue_reqs.set(sum(s.num_queue_reqs for s in ranks))
        total = sum(s.kv_total for s in ranks)
        self.token_usage.set(sum(s.kv_used for s in ranks) / total if total else 0.0)
        tiers = [s.hicache for s in ranks if s.hicache]
        for tier in ("host", "storage"):
            for counter in TIER_COUNTERS:
                if any(tier in t for t in tiers):
                    self.hicache.labels(**self.labels, tier=tier, counter=counter).set(
                        sum(t[tier].get(counter, 0) for t in tiers if tier in t))
            if tiers:
                self.hicache_loaded.labels(**self.labels, tier=tier).set(sum(t["loaded_tokens"][tier] for t in tiers))

    def on_output(self, state: ReqState, out: ReqOutput, had_first_token: bool) -> None:
        self.generation_tokens.inc(len(out.new_output_ids))
        if not had_first_token and state.first_token_time is not None:
            self.ttft.observe(state.first_token_time - state.created)
        if out.finish_reason is not None:
            self.num_requests.inc()
            if out.finish_reason.get("type") == "abort":
                self.num_aborted_requests.inc()
            self.prompt_tokens.inc(out.prompt_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            self._prompt_total += out.prompt_tokens
            self._cached_total += out.cached_tokens
            self.cache_hit_rate.set(self._cached_total / max(self._prompt_total, 1))
            self.e2e.observe(state.finish_time - state.created)

    def render(self) -> bytes:
        return generate_latest(self.registry)
