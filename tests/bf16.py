"""The bf16 accuracy contract (docs/ENGINE.md, "bf16 parity"), one helper for every bf16 test.

A bf16 run is not compared with another bf16 run: two bf16 computations round at different
points (oneDNN takes other code paths on AMX than on AVX512-BF16, torch's flash attention
rounds otherwise than our kernel), and two such references disagree with each other by more
than any fixed constant tuned on one host. Both are compared with **fp32**, and the
tolerance is **measured on the spot**: the largest difference between a reference bf16
computation (HF's bf16 forward, torch's bf16 attention) and the same computation in fp32 on
the same inputs, on this host, is what bf16 rounding costs here (`noise`).

- Tensors (kernels, operators): every element of the engine's bf16 result is within
  `HEADROOM * noise` of the fp32 result.
- Tokens (greedy decoding): teacher-forced fp32 logits over the engine's own output; each
  token the engine chose is within `2 * HEADROOM * noise` of that position's fp32 maximum. Two
  logits each off by at most e can trade places only if their fp32 values are within 2e; a
  bf16 forward off by at most HEADROOM times the reference's own noise (e per logit) can
  therefore choose only tokens within 2 * HEADROOM * e of the maximum. The noise is measured
  on the logits that can win, the TOP_K highest fp32 logits at each position: the error of
  tail logits (tens below the maximum, and in a random model's tail several units larger)
  never decides a token.

HEADROOM = 2: the engine's bf16 computation is not the reference's (other summation orders,
its own kernels), so its error may be somewhat larger than the reference's; a broken one (a
wrong head order, a wrong key packing) is off by the size of the values themselves, many
times more (tests/test_bf16_contract.py shows both on this host).
"""

from __future__ import annotations

import torch

HEADROOM = 2.0
TOP_K = 8
SKIP_REASON = "no AVX-512 on this CPU: bf16 matmuls are emulated (the references would take minutes)"


def runs_here() -> bool:
    """Whether this CPU runs the bf16 engine tests: with bf16 dot products (AVX512-BF16, AMX),
    or AVX-512 without them, where the engine's fused forward runs bf16 on its own kernels
    (engine/packed_linear.py's bf16_widened) and oneDNN's emulated bf16 GEMM (avx512_core) takes
    the references' forwards in seconds. On AVX2-only CPUs torch's bf16 matmuls are emulated
    tens of times slower than fp32 (docs/BENCHMARKS.md §8.2): the SmolLM2 run would take many
    minutes there."""
    from engine.dtypes import native_bf16_cpu

    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return native_bf16_cpu() or bool(onednn)


def noise(ref32: torch.Tensor, ref16: torch.Tensor, top_k: int | None = None) -> float:
    """What bf16 rounding costs a computation on this host: the largest |bf16 - fp32| (of
    logits: among the `top_k` highest fp32 values of each row)."""
    err = (ref16.float() - ref32.float()).abs()
    if top_k is not None:
        err = err.gather(-1, ref32.float().topk(top_k, dim=-1).indices)
    return float(err.max())


def assert_tensor_within_noise(got: torch.Tensor, ref32: torch.Tensor, ref16: torch.Tensor, what: str = "output") -> float:
    """`got` (a bf16 result) is within HEADROOM times the reference's bf16 noise of fp32.
    Returns the tolerance used."""
    tol = HEADROOM * noise(ref32, ref16)
    err = (got.float() - ref32.float()).abs()
    worst = float(err.max())
    assert worst <= tol, (f"{what}: bf16 result off fp32 by {worst:.3g} at {tuple(int(i) for i in torch.nonzero(err == worst)[0])}, "
                          f"more than {HEADROOM} x the bf16 reference's own {tol / HEADROOM:.3g}")
    return tol


@torch.inference_mode()
def logits(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(ids), V] in fp32."""
    return model(torch.tensor([ids], device=model.device)).logits[0].float()


@torch.inference_mode()
def assert_tokens_within_noise(model_dir: str, prompt: list[int], got: list[int], device: str = "cpu",
                               load=None) -> float:
    """Every token of the engine's bf16 greedy output `got` is within 2 * HEADROOM * noise of
    the fp32 maximum at its position, the logits teacher-forced over the engine's own output;
    `noise` is HF's bf16 forward against its fp32 forward over the same tokens, on each
    position's TOP_K fp32 candidates. `load(dtype)` gives the HF model (default: SDPA
    attention; families whose features SDPA lacks pass their eager loader). Returns the
    tolerance used."""
    from tests.models import load_reference

    load = load or (lambda dtype: load_reference(model_dir, device, dtype))
    ids = prompt + got
    l32, l16 = logits(load("float32"), ids), logits(load("bfloat16"), ids)
    tol = 2 * HEADROOM * noise(l32, l16, TOP_K)
    out = l32[len(prompt) - 1:-1]                                        # [len(got), V]
    chosen = out.gather(1, torch.tensor(got, device=out.device)[:, None])[:, 0]
    gaps = out.max(dim=-1).values - chosen
    worst = int(gaps.argmax())
    assert float(gaps[worst]) <= tol, (
        f"output {worst} (token {got[worst]}) is {float(gaps[worst]):.3g} below the fp32 maximum "
        f"(token {int(out[worst].argmax())}); bf16 noise here allows {tol:.3g}\n got={got}")
    return tol
