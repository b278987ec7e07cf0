"""Shared fixtures: tiny random models built from a config (fast), the real default model
(slow), and a Hugging Face reference to compare against."""

from __future__ import annotations

import os

import pytest

# Tests must never reach a model hub; everything is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
def tiny_model(tmp_path_factory, tokenizer_dir):
    """Factory: a tiny random model of a family, saved with SmolLM2's tokenizer."""
    from tests.models import build_tiny_model

    made: dict[str, str] = {}

    def make(family: str = "llama") -> str:
        if family not in made:
            made[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), tokenizer_dir)
        return made[family]

    return make
