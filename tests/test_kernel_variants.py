"""The kernels' instruction-set variants (engine/kernels.py): which one a CPU gets, and each
variant this host can execute against the pure-torch reference, in its own process (a
process loads one variant)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import kernels
from engine.dtypes import cpu_flags

BASE = {"sse4_2", "popcnt"}
AVX2 = BASE | {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
HOSTS = {   # flags as /proc/cpuinfo lists them on the hosts the project has run on (the relevant subset)
    "zen1 (AVX2 only)": (AVX2 | {"sha_ni"}, "avx2"),
    "skylake-x (AVX-512)": (AVX512, "avx512"),
    "ice lake (AVX512-VNNI, no AVX512-BF16)": (AVX512 | {"avx512_vnni", "avx512_vbmi", "avx512ifma"}, "avx512_vnni"),
    "zen5 (AVX512-BF16)": (AVX512 | {"avx512_bf16", "avx512_vnni"}, "avx512_bf16"),
    "sapphire rapids (AMX)": (AVX512 | {"avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"},
                              "avx512_bf16"),
    "avx512-bf16 without vnni (none known)": (AVX512 | {"avx512_bf16"}, "avx512"),
    "pre-haswell": (BASE | {"avx"}, "x86_64"),
}


@pytest.mark.skipif(kernels.variants() == (kernels.NATIVE,), reason="not x86-64: one native build")
@pytest.mark.parametrize("host", HOSTS)
def test_each_cpu_gets_the_best_variant_it_can_run(host, monkeypatch):
    flags, want = HOSTS[host]
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    assert kernels.choose_variant(frozenset(flags)).name == want


@pytest.mark.skipif(kernels.variants() == (kernels.NATIVE,), reason="not x86-64: one native build")
def test_a_forced_variant_this_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "avx512_bf16")
    with pytest.raises(ValueError, match="lacks avx512_bf16"):
        kernels.choose_variant(frozenset(AVX512))
    monkeypatch.setenv(kernels.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="the variants are avx512_bf16, avx512_vnni, avx512, avx2, x86_64"):
        kernels.choose_variant(frozenset(AVX512))
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert kernels.choose_variant(frozenset(AVX512)).name == "avx2"


def test_this_process_runs_the_variant_chosen_for_its_cpu():
    assert kernels.loaded_variant() == kernels.choose_variant().name


OPERATOR_TESTS = ["test_rms_norm_and_residual_add_match_transformers", "test_rotary_in_place_matches_transformers",
                  "test_silu_and_mul_matches_torch", "test_bf16_operators_round_where_transformers_does"]
RUNNABLE = [v.name for v in kernels.variants() if v.runs_here(cpu_flags()) and v != kernels.choose_variant()]


VARIANT_TESTS = ["tests/test_paged_kernel.py", "tests/test_decode_walk.py", "tests/test_attention_work.py",
                 "tests/test_decode_parts.py",
                 *[f"tests/test_fused_llama.py::{name}" for name in OPERATOR_TESTS],
                 "tests/test_packed_linear.py::test_packed_linear_matches_nn_linear_for_any_row_count",
                 "tests/test_linear_int8.py", "tests/test_linear_bf16.py", "tests/test_logits_kernel.py",
                 "tests/test_linear_silu.py", "tests/test_kv_int8.py",
                 "tests/test_kernel_variants.py::test_this_process_runs_the_variant_chosen_for_its_cpu"]

# Plugins these tests do not use, each seconds of imports a process (langsmith's, hypothesis's).
NO_PLUGINS = [arg for name in ("cacheprovider", "langsmith_plugin", "hypothesispytest", "anyio")
              for arg in ("-p", f"no:{name}")]


@pytest.fixture(scope="module")
def variant_runs(request, tmp_path_factory):
    """The pytest subprocess of every variant this pytest run selected, all started at once:
    each spends ~20 s starting an interpreter, importing torch and collecting, on one thread
    (OMP_NUM_THREADS=1, and tests/conftest.py sets torch to one), so together they take
    little more than the slowest alone. Each test waits on its own variant's process."""
    wanted = [item.callspec.params["variant"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_variant_matches_the_torch_reference"]
    runs = {}
    for variant in dict.fromkeys(wanted):
        out = tmp_path_factory.mktemp(f"variant-{variant}") / "output.txt"
        env = {**os.environ, kernels.ISA_ENV: variant, "OMP_NUM_THREADS": "1", "MAX_JOBS": "1"}   # a build (csrc changed since set-up): one compiler each
        with open(out, "w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", *NO_PLUGINS, *VARIANT_TESTS],
                                    stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
        runs[variant] = (proc, out)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("variant", RUNNABLE)
def test_variant_matches_the_torch_reference(variant, variant_runs):
    """Every operator of the library built for `variant` — the attention kernel (fp32, bf16,
    fp16 pools), the packed linear kernel, the int8 and bf16-weight linear kernels and the fused layer operators — against the
    pure-torch reference: the same tests the chosen variant passes in this process, in a
    process that loads `variant` (and checks it loaded it)."""
    proc, out = variant_runs[variant]
    try:
        proc.wait(timeout=1200)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    tail = out.read_text()[-5000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail, tail
