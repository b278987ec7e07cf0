"""The vLLM-named load series existing LLM routers scrape from `/metrics` to balance
replicas (Gateway API Inference Extension endpoint picker, llm-d, vLLM production-stack
router), computed at scrape time from the engine's `EngineStats` snapshot:

    vllm:num_requests_waiting      gauge  stats.waiting   (queued, not yet scheduled)
    vllm:num_requests_running      gauge  stats.running   (in the running batch)
    vllm:kv_cache_usage_perc       gauge  stats.kv_cache_usage  (a fraction 0..1, as vLLM)
    vllm:gpu_cache_usage_perc      gauge  the same value, under vLLM's older name
    vllm:cache_config_info         gauge  1, labels block_size and num_gpu_blocks
                                          (stats.block_size, stats.kv_blocks_total)

Every series has a `model_name` label (the served model id). While the model loads
(`stats` returns None) nothing is exposed, so routers read the replica as not ready.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import EngineStats

LOAD_SERIES = (  # (name, EngineStats field, help)
    ("vllm:num_requests_waiting", "waiting", "Requests waiting to be scheduled."),
    ("vllm:num_requests_running", "running", "Requests in the running batch."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage: 1 means every block is used."),
    ("vllm:gpu_cache_usage_perc", "kv_cache_usage",
     "KV-cache usage: 1 means every block is used (older name of vllm:kv_cache_usage_perc)."),
)


class VllmMetrics(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str):
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.stats()
        if stats is None:
            return
        for name, key, doc in LOAD_SERIES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(stats, key)))
            yield family
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV-cache config.",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([self.model_name, str(stats.block_size), str(stats.kv_blocks_total)], 1.0)
        yield info


def register_vllm_metrics(registry: CollectorRegistry, stats: Callable[[], EngineStats | None],
                          model_name: str) -> VllmMetrics:
    """Expose the vLLM-named series on `registry`, read from `stats()` at each scrape."""
    collector = VllmMetrics(stats, model_name)
    registry.register(collector)
    return collector
