"""engine/huge_pages.py: the packed linear weights copied into one region advised for huge
pages, side by side in the order a step reads them; and the engine's use of it
(EngineConfig.huge_pages), which must not change a token."""

from __future__ import annotations

import mmap

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import load_kernels
from engine.packed_linear import _stream
from engine.huge_pages import ALIGN, HUGE_PAGE, Arena, huge_bytes


def thp_mode() -> str | None:
    """The host's transparent huge page mode (always, madvise, never), None where unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def place(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` side by side in one Arena, in this order (as packed_linear.arrange makes them)."""
    arena = Arena([t.numel() * t.element_size() for t in tensors])
    return [arena.copy(i, t) for i, t in enumerate(tensors)]


def assert_side_by_side(tensors: list[torch.Tensor]) -> None:
    """Each tensor starts on a 4 KiB boundary at the first one after the one before it."""
    for a, b in zip(tensors, tensors[1:]):
        size = a.numel() * a.element_size()
        assert b.data_ptr() == a.data_ptr() + -(-size // ALIGN) * ALIGN, (a.shape, b.shape)
    assert all(t.data_ptr() % ALIGN == 0 for t in tensors)


def test_place_copies_in_order_aligned_in_one_region():
    torch.manual_seed(0)
    tensors = [torch.randn(3, 5), torch.randint(-127, 128, (7, 9, 16), dtype=torch.int8),
               torch.randn(5000).to(torch.bfloat16), torch.randn(1), torch.randn(40, 1024)]
    placed = place(tensors)
    for t, p in zip(tensors, placed):
        assert (p.shape, p.dtype) == (t.shape, t.dtype) and p.is_contiguous() and torch.equal(p, t)
        assert p.data_ptr() != t.data_ptr()
    assert_side_by_side(placed)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert placed[0].data_ptr() % HUGE_PAGE == 0
    tensors[4].zero_()                                          # copies, not views of the originals
    assert placed[4].abs().sum() > 0


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off on this host")
def test_place_gets_huge_pages_where_the_host_has_them():
    big = place([torch.ones(8 << 20, dtype=torch.uint8)])[0]
    assert huge_bytes(big) >= HUGE_PAGE
    assert huge_bytes(torch.ones(4)) is not None                  # smaps read for ordinary memory too


def streamed(eng: LLMEngine) -> list[torch.Tensor]:
    """The packed tensors the engine's linears stream, in the order a step calls them (the fused
    forward's) or the model's module order (the transformers forward's)."""
    forward = eng.runner.forward
    if hasattr(forward, "layers"):
        modules = [m for layer in forward.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        modules.append(forward.lm_head)
    else:
        modules = list(eng.runner.model.modules())
    holders = [s for s in (_stream(m) for m in modules) if s is not None]
    return [getattr(holder, name) for holder, name in holders]


def greedy(eng: LLMEngine) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(100, 140)), params)          # chunked prefill, then decode
    eng.add_request("b", list(range(300, 306)), params)
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.skipif(not load_kernels(), reason="the C++ kernels did not build (see the log)")
@pytest.mark.parametrize("case", [
    {"quantization": "int8"},                                   # fused, int8 codes
    {"dtype": "bfloat16"},                                      # fused, bf16 blocks
    {},                                                         # fused, fp32 packed blocks
    {"quantization": "int8", "fused_layers": False},            # transformers' forward, int8 linears
], ids=["fused-int8", "fused-bf16", "fused-fp32", "hf-int8"])
def test_engine_streams_weights_side_by_side_and_makes_the_same_tokens(tiny_model, case):
    tokens = {}
    for huge in (True, False):
        eng = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=64, max_num_batched_tokens=16,
                                     max_num_seqs=4, huge_pages=huge, **case))
        weights = streamed(eng)
        assert len(weights) >= 2 * 4
        if huge:
            assert_side_by_side(weights)
            if thp_mode() in ("madvise", "always"):
                assert huge_bytes(weights[0]) >= HUGE_PAGE
        else:
            assert any(b.data_ptr() != a.data_ptr() + -(-a.numel() * a.element_size() // ALIGN) * ALIGN
                       for a, b in zip(weights, weights[1:]))
        tokens[huge] = greedy(eng)
    assert tokens[True] == tokens[False] and all(len(t) == 8 for t in tokens[True].values())


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off on this host")
def test_the_cpu_kv_pool_is_in_huge_pages_and_left_out_of_the_isolation_bench_rss():
    """The pool (kv_cache.zeroed) takes huge pages as blocks are written; bench/isolation's RSS
    leaves it out, as it leaves out what the weights set aside, and counts the heap."""
    import os

    from bench.isolation.victim import rss_bytes
    from engine.kv_cache import PagedKVCache

    cache = PagedKVCache(num_layers=2, num_blocks=2048, block_size=16, num_kv_heads=4, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    assert huge_bytes(cache.k) == 0 and cache.k.data_ptr() % HUGE_PAGE == 0
    before = rss_bytes(os.getpid())
    cache.k.view(-1)[: 16 << 20].fill_(1.0)                     # 32 MiB of the pool written
    assert huge_bytes(cache.k) >= 16 << 20
    # 32 MiB of fresh memory not advised (the allocator might hand out pages already resident)
    heap = torch.frombuffer(mmap.mmap(-1, 32 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    heap.fill_(1)
    grown = rss_bytes(os.getpid()) - before
    assert 30 << 20 <= grown <= 44 << 20, grown                 # the fresh 32 MiB, not the pool's
    assert heap.sum() == 32 << 20


def test_arrange_lets_each_weight_go_once_copied(monkeypatch):
    """Loading holds one weight twice at most: when the i-th packed tensor is copied into the
    arena, the ones before it are already freed (and after arrange, all of them)."""
    import gc
    import weakref

    from torch import nn

    import engine.huge_pages as huge_pages
    from engine.packed_linear import arrange
    from engine.quantization import Int8Linear

    torch.manual_seed(0)
    modules = [Int8Linear(nn.Linear(64, 48 + 16 * i)) for i in range(4)]
    originals = [weakref.ref(m.weight_int8.codes) for m in modules]
    alive_at_copy = []
    copy = huge_pages.Arena.copy

    def recording(self, i, t):
        gc.collect()
        alive_at_copy.append([r() is not None for r in originals[:i]])
        return copy(self, i, t)

    monkeypatch.setattr(huge_pages.Arena, "copy", recording)
    moved = arrange(modules)
    gc.collect()
    assert alive_at_copy == [[False] * i for i in range(4)]
    assert all(r() is None for r in originals)
    assert moved == sum(m.weight_int8.codes.numel() for m in modules)
    assert_side_by_side([m.weight_int8.codes for m in modules])
