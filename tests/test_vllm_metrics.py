"""vLLM-named replica signals: the names, types and labels routers scrape, parsed back from
the text exposition with prometheus_client's own parser."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineConfig, EngineStats, LLMEngine, SamplingParams
from gateway.vllm_metrics import register_vllm_metrics

STATS = EngineStats(waiting=3, running=5, kv_cache_usage=0.25, block_size=16, kv_blocks_total=512)


def scrape(stats) -> dict:
    registry = CollectorRegistry()
    register_vllm_metrics(registry, stats, "tiny-llama")
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_series_names_types_labels_and_values():
    """Each vLLM series is a gauge with a model_name label and the stats' value."""
    families = scrape(lambda: STATS)
    expected = {"vllm:num_requests_waiting": 3, "vllm:num_requests_running": 5,
                "vllm:kv_cache_usage_perc": 0.25, "vllm:gpu_cache_usage_perc": 0.25}
    for name, value in expected.items():
        (sample,) = families[name].samples
        assert families[name].type == "gauge"
        assert sample.name == name and sample.labels == {"model_name": "tiny-llama"}
        assert sample.value == value
    (info,) = families["vllm:cache_config_info"].samples
    assert families["vllm:cache_config_info"].type == "gauge"
    assert info.labels == {"model_name": "tiny-llama", "block_size": "16", "num_gpu_blocks": "512"}
    assert info.value == 1.0


def test_values_are_read_at_each_scrape_and_absent_while_loading():
    """The collector reads the stats callable per scrape; None (model loading) exposes nothing."""
    current: dict = {"stats": None}
    registry = CollectorRegistry()
    register_vllm_metrics(registry, lambda: current["stats"], "m")
    assert "vllm:" not in generate_latest(registry).decode()
    current["stats"] = dataclasses.replace(STATS, waiting=7)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert families["vllm:num_requests_waiting"].samples[0].value == 7


def test_a_real_engines_stats_feed_the_series(tiny_model):
    """The fields the collector reads are those LLMEngine.snapshot() fills in, and a
    queued request shows up as waiting, a scheduled one as running with KV in use."""
    engine = LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64,
                                    max_num_seqs=8, max_model_len=256, num_kv_blocks=256))
    engine.add_request("r1", list(range(5, 25)), SamplingParams(max_tokens=4))
    families = scrape(engine.snapshot)
    assert families["vllm:num_requests_waiting"].samples[0].value == 1
    engine.step()
    families = scrape(engine.snapshot)
    assert families["vllm:num_requests_running"].samples[0].value == 1
    assert 0 < families["vllm:kv_cache_usage_perc"].samples[0].value <= 1
    info = families["vllm:cache_config_info"].samples[0].labels
    assert int(info["num_gpu_blocks"]) == engine.snapshot().kv_blocks_total > 0
