"""Engine metrics for Prometheus (vLLM-style names), per engine instance.

Latency histograms are observed as requests progress; everything else (queue lengths, KV
usage, preemptions, deadline drops, per-tenant service...) is read from an `EngineStats`
snapshot when Prometheus scrapes, so the step loop does no extra bookkeeping for it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .sequence import Sequence

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PREFIX = "streamgate"


class EngineMetrics:
    def __init__(self, stats_fn, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive output tokens of a request.")
        self.tpot = hist("time_per_output_token_seconds", "Mean gap between output tokens, per finished request.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.registry.register(_StatsCollector(stats_fn))

    def on_token(self, seq: Sequence, now: float) -> None:
        if seq.last_token_time is None:
            self.ttft.observe(now - seq.arrival_time)
            if seq.first_scheduled_time is not None:
                self.queue_time.observe(seq.first_scheduled_time - seq.arrival_time)
        else:
            self.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now

    def on_finish(self, seq: Sequence, now: float) -> None:
        self.e2e.observe(now - seq.arrival_time)
        if seq.first_token_time is not None and seq.num_output_tokens > 1 and seq.last_token_time is not None:
            self.tpot.observe((seq.last_token_time - seq.first_token_time) / (seq.num_output_tokens - 1))


class _StatsCollector:
    """Turns an `EngineStats` snapshot (from `stats_fn()`) into gauges and counters at
    scrape time; None (no snapshot yet) exposes nothing."""

    GAUGES = {
        "num_requests_waiting": ("waiting", "Requests waiting to be scheduled."),
        "num_requests_running": ("running", "Requests in the batch."),
        "num_requests_swapped": ("swapped", "Requests whose KV is in the host pool."),
        "batch_occupancy": ("batch_occupancy", "running / max_num_seqs."),
        "token_budget_usage": ("token_budget_usage", "Last step's tokens / its token budget."),
        "token_budget": ("token_budget", "Last step's token budget (adaptive with itl_target_ms)."),
        "kv_cache_usage": ("kv_cache_usage", "Used KV blocks / all KV blocks."),
        "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache."),
        "num_requests_starving": ("starving", "Waiting requests older than the starvation threshold."),
    }
    COUNTERS = {
        "recomputed_tokens": ("recomputed_tokens", "Tokens recomputed after recompute preemption."),
        "seat_preemptions": ("seat_preemptions", "Preemptions that gave an arrival its seat (fair / priority)."),
        "swapped_bytes": ("swapped_bytes", "KV bytes copied to and from the host pool."),
        "rejections": ("rejections", "Requests refused because a queue limit was reached."),
        "deadline_drops": ("deadline_drops", "Requests dropped before prefill: deadline passed while queued."),
        "deadline_finishes": ("deadline_finishes", "Requests ended by their deadline after starting."),
        "prompt_tokens": ("prompt_tokens", "Prompt tokens computed (prefill, including recompute)."),
        "generation_tokens": ("generation_tokens", "Output tokens generated."),
    }

    def __init__(self, stats_fn):
        self._stats_fn = stats_fn

    def collect(self):
        s = self._stats_fn()
        if s is None:
            return
        for name, (key, doc) in self.GAUGES.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=getattr(s, key))
        for name, (key, doc) in self.COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=getattr(s, key))
        pre = CounterMetricFamily(f"{PREFIX}_num_preemptions", "Preemptions by mode.", labels=["mode"])
        pre.add_metric(["recompute"], s.preemptions_recompute)
        pre.add_metric(["swap"], s.preemptions_swap)
        yield pre
        served = CounterMetricFamily(f"{PREFIX}_tenant_served_tokens", "Tokens served per tenant.",
                                     labels=["tenant", "kind"])
        for tenant, (inp, outp) in s.tenant_served_tokens.items():
            served.add_metric([tenant, "input"], inp)
            served.add_metric([tenant, "output"], outp)
        yield served
        vtc = GaugeMetricFamily(f"{PREFIX}_tenant_virtual_tokens", "Fair policy's virtual token counter.",
                                labels=["tenant"])
        for tenant, value in s.fair_counters.items():
            vtc.add_metric([tenant], value)
        yield vtc
