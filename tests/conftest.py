"""Shared fixtures: tiny random models built from a config (fast), the real default model
(slow), and a Hugging Face reference to compare against."""

from __future__ import annotations

import os

import pytest

# Tests must never reach a model hub; everything is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# OpenMP threads that wait for work sleep instead of spinning (set before torch loads
# libgomp; servers and subprocesses the tests start inherit it). On a shared 2-core host a
# spinning thread takes the core the working one needs: the SmolLM2 tests at two threads ran
# 2.5x longer. Results do not change, only how idle threads wait.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers) the controller converts the default
    model before any worker starts, so two workers never convert it at once."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    from engine.models import resolve_model

    try:
        resolve_model("default")
    except Exception:           # the tests that need it report it (default_model_dir); the rest run
        pass


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and OpenMP's spinning threads slow
    to a crawl when another process shares the two cores. The SmolLM2 tests opt back in."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _json_logs():
    """The gateway's structlog setup, so its log lines go through logging (captured per test)."""
    from gateway.logs import configure_logging

    configure_logging()


@pytest.fixture
def all_threads():
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(1)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


NO_CUDA = "no CUDA device on this machine: the CUDA parity run needs a GPU (see scripts/gpu_check.sh)"

# (device, dtype) pairs parity tests run on; CUDA entries skip with a stated reason.
DEVICES = [
    pytest.param(("cpu", "float32"), id="cpu-fp32"),
    pytest.param(("cuda", "bfloat16"), id="cuda-bf16",
                 marks=[pytest.mark.cuda, pytest.mark.skipif(not cuda_available(), reason=NO_CUDA)]),
]


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted SmolLM2-135M-Instruct directory (converted once into the cache)."""
    from engine.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tokenizer_dir(default_model_dir) -> str:
    return default_model_dir


@pytest.fixture(scope="session")
def repeat_model(tmp_path_factory, tokenizer_dir) -> str:
    """A ~4M-parameter random Llama with tied embeddings and initializer_range 0.1: its greedy
    output falls into runs of one repeated token broken by context-dependent changes, so n-gram
    proposals are both accepted and rejected (tests/test_speculative.py, tests/test_tp.py)."""
    import torch
    import transformers

    from tests.models import TINY

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(vocab_size=len(tok), **{**TINY, "initializer_range": 0.1,
                                                                 "tie_word_embeddings": True})
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(1234)
    out = tmp_path_factory.mktemp("tiny-repeat")
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer_dir):
    """Factory: a tiny random model of a family, saved with SmolLM2's tokenizer."""
    from tests.models import build_tiny_model

    made: dict[str, str] = {}

    def make(family: str = "llama") -> str:
        if family not in made:
            made[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), tokenizer_dir)
        return made[family]

    return make



# -- markers: what `make test-fast` (-m "not slow") leaves out -----------------------------
# Set here, by module (and a few tests), rather than in each file, and decided by timing:
# `pytest --durations=0` on the 2-core development host (AMD EPYC Zen 4, AVX-512) on
# 2026-12-01, shared with other jobs. `e2e`: drives a real server over a socket (uvicorn in a
# thread, `streamgate serve` subprocesses, the browser); every e2e test is also slow. `slow`:
# also subprocesses that run a benchmark, redis-server, tensor-parallel ranks, the real
# SmolLM2, and the tiny models' runs of hundreds of engine steps (the parity matrix, the
# scheduler under pressure, the engine thread). `make test` runs everything.
E2E_MODULES = {
    "test_browser", "test_cli_serve", "test_scale_replicas", "test_gateway_connections",
    "test_gateway_http", "test_gateway_isolation", "test_gateway_lifecycle", "test_gateway_quota",
    "test_gateway_ws", "test_bench_serve", "test_bench_isolation", "test_bench_peers",
    "test_bench_pooled",
    "test_api_chat", "test_api_clients", "test_api_endpoints", "test_api_reasoning", "test_api_ws",
    "test_api_harmony", "test_gateway_hardening", "test_ledger_fails_closed", "test_api_tool_stream",
    "test_api_line_breaks",
}
SLOW_MODULES = E2E_MODULES | {
    "test_bench",                                               # bench.engine.offline / bench.engine.gemm subprocesses
    "test_quota_redis", "test_quota_redis_failures", "test_quota_redis_prepay",   # redis-server
    "test_tp",                                                  # tensor-parallel ranks (processes)
    "test_parity", "test_fair_seats", "test_compile", "test_fused_llama",         # parity matrix
    "test_pressure", "test_async_engine",                       # hundreds of steps on tiny models
    "test_quota_redis_idempotent",                              # redis-server
    "test_families", "test_grammar",            # parity per family under preemption; grammar property
    "test_kv_int8_engine",                      # the int8 KV cache's parity matrix, 2 TP ranks
}
# Single tests of otherwise fast (or slow) modules, by function name (every parametrization).
E2E_TESTS = {"test_tp": ("test_killed_rank_fails_the_stream_and_health_and_sigterm_ends_the_tree",)}
SLOW_TESTS = {                                                   # each 3-16 s of engine steps
    "test_bench_scheduling": ("test_smoothness_and_burst_run_on_a_real_engine",),
    "test_threads": ("test_small_steps_are_bit_identical_on_one_or_all_threads",        # SmolLM2
                     "test_engine_with_adaptive_threads_measures_both_and_matches"),
    "test_budget": ("test_engine_feeds_the_budget_and_it_grows_on_a_fast_model",),
    "test_static_batching": ("test_static_batching_waits_for_the_batch_and_keeps_outputs",),
    # 2026-12-02 timing (the same host, shared): each over ~1 s on a quiet host
    "test_kernel_variants": ("test_variant_matches_the_torch_reference",),   # a pytest subprocess per variant
    "test_bf16_contract": ("test_a_broken_kernel_fails_the_contract_a_sound_one_passes",),
    "test_speculative": ("test_greedy_output_equals_hf_and_no_speculation_under_chunking_and_prefix_caching",
                         "test_greedy_output_is_unchanged_under_preemption",
                         "test_stops_inside_an_accepted_run_end_where_the_plain_run_ends",
                         "test_rows_that_may_not_speculate_decode_beside_rows_that_do",
                         "test_smollm2_bf16_output_with_speculation_equals_the_plain_run"),
    "test_speculative_config": ("test_the_benchmark_runs_and_finds_the_same_tokens",
                                "test_sliding_window_families_keep_their_output"),
    "test_engine_speed": ("test_auto_backend_takes_the_kernel_where_it_builds",),
    "test_bench_serve_loadgen": ("test_tenant_rates_set_the_mix_of_tenants",),
    "test_bench_report_profile": ("test_forwards_rows_are_the_runs_medians",),
    "test_bench_report_families": ("test_a_real_speed_run_renders_its_json_rows",),   # 5-14 s: a real benchmark run
    "test_bench_report_kv_int8": ("test_the_benchmark_runs_and_its_json_renders",),   # 3-5 s: a real benchmark run
}
# One greedy-parity run on the default CPU path stays in the fast set as its smoke check.
FAST_TESTS = {"test_parity": ("test_greedy_parity_chunked_mixed_batches[llama-cpu-fp32-kernel]",)}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module, name = item.path.stem, getattr(item, "originalname", item.name)
        e2e = module in E2E_MODULES or name in E2E_TESTS.get(module, ())
        if e2e:
            item.add_marker(pytest.mark.e2e)
        if item.name in FAST_TESTS.get(module, ()):
            continue
        if e2e or module in SLOW_MODULES or name in SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)
