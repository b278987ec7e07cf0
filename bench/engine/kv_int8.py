"""The int8 KV cache (`--kv-cache-dtype int8`, csrc/kv_int8.h) against the model dtype's: decode
speed, bytes, perplexity, greedy agreement.

    python -m bench.engine.kv_int8 [--model default] [--dtype bfloat16] [--rows 1,8,32] [--ctx 320]
                                   [--steps 30] [--ppl-tokens 4096] [--window 512] [--agree-tokens 64]

- decode: two in-process engines on the same model and dtype, one with its KV cache in the
  dtype, one in int8; for each row count, that many sequences (`--ctx`-token prompts, no
  shared prefix) decode, the two engines' steps alternating (the order flips every round), so
  a shared host's load falls on both. Median step per engine and the ratio.
- bytes: a KV block's bytes in either pool (int8: head_dim values and a 4-byte scale a row).
- perplexity: transformers' forward in the dtype on held-out text (README.md then
  docs/ENGINE.md, `--ppl-tokens` tokens in windows of `--window`), with its attention reading
  the keys and values as stored (`int8_kv_attention`: rounded through int8 rows) or not.
- greedy agreement: six chat prompts, `--agree-tokens` tokens each, on both engines: the share
  of tokens before the first difference (and of equal positions); fp32 against the dtype as
  the yardstick of what a mere change of rounding does.
Writes --json-out (bench/results/kv-int8.json); `python -m bench report` renders it (§10).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from bench.engine.int8 import CHAT, agreement, chat_greedy, held_out_ids, perplexity

INT8_KV_ATTENTION = "streamgate_int8_kv_sdpa"


def register_int8_kv_attention() -> str:
    """Registers with transformers an SDPA attention that reads the whole cache's keys and
    values rounded through the engine's int8 rows (engine/kv_cache.py's quantize_rows, per
    token and head); returns its name for `attn_implementation`. The reference for the int8
    KV cache (tests/test_kv_int8_engine.py) and this benchmark's perplexity."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine.kv_cache import dequantize_rows, quantize_rows

    def attention(module, query, key, value, attention_mask, **kwargs):
        def rounded(x):
            return dequantize_rows(quantize_rows(x), x.dtype)
        return sdpa_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kwargs)

    AttentionInterface.register(INT8_KV_ATTENTION, attention)
    return INT8_KV_ATTENTION


def _engines(model: str, dtype: str, blocks: int) -> dict:
    from engine import EngineConfig, LLMEngine

    common = dict(model=model, dtype=dtype, num_kv_blocks=blocks, max_num_batched_tokens=2048, max_num_seqs=64,
                  enable_prefix_caching=False)
    return {"dtype": LLMEngine(EngineConfig(**common)), "int8": LLMEngine(EngineConfig(**common, kv_cache_dtype="int8"))}


def decode_rows(engines: dict, rows: int, ctx: int, steps: int) -> dict[str, list[float]]:
    """`rows` sequences decoding in each engine, steps alternating; each engine's step times."""
    from engine import SamplingParams

    rng = random.Random(rows)
    prompts = [[rng.randrange(1000, 40000) for _ in range(ctx)] for _ in range(rows)]
    for name, eng in engines.items():
        for i, p in enumerate(prompts):
            eng.add_request(f"{name}-{rows}-{i}", p, SamplingParams(max_tokens=steps + 4, temperature=0.0,
                                                                    ignore_eos=True))
        while eng.stats()["waiting"] or any(s.is_prefill for s in eng.scheduler.running):
            eng.step()
        eng.step()                                                      # one warm decode step
    times: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(steps):
        for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
            start = time.perf_counter()
            engines[name].step()
            times[name].append(time.perf_counter() - start)
    for eng in engines.values():
        while eng.has_unfinished():
            eng.step()
    return times


def perplexities(model_dir: str, dtype: str, ids: list[int], window: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for name, attn in (("float32", "sdpa"), ("dtype", "sdpa"), ("int8", register_int8_kv_attention())):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32 if name == "float32" else
                                                     getattr(torch, dtype), attn_implementation=attn).eval()
        out[name] = perplexity(model, ids, window)
        print(f"perplexity {name}: {out[name]:.3f}", flush=True)
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", default="1,8,32", help="decoding sequences, comma-separated")
    p.add_argument("--ctx", type=int, default=320, help="each decoding sequence's prompt tokens")
    p.add_argument("--steps", type=int, default=30, help="decode rounds (one step of each engine per round)")
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--agree-tokens", type=int, default=64)
    p.add_argument("--json-out", default="bench/results/kv-int8.json")
    args = p.parse_args(argv)

    from bench.provenance import provenance, write_json
    from engine.kernels import loaded_variant
    from engine.models import resolve_model

    prov = provenance("engine.kv_int8", argv)
    model_dir = str(resolve_model(args.model))
    rows = [int(r) for r in args.rows.split(",")]
    blocks = max(rows) * (-(-(args.ctx + args.steps + 8) // 16)) + len(CHAT) * 16 + 64
    engines = _engines(args.model, args.dtype, blocks)
    caches = {name: eng.runner.kv_cache for name, eng in engines.items()}
    block_bytes = {name: c.bytes_per_block for name, c in caches.items()}
    print(f"kernels: {loaded_variant()}; KV block bytes {block_bytes}; load {os.getloadavg()[0]:.1f}", flush=True)
    decode, loads = {}, []
    for r in rows:
        times = decode_rows(engines, r, args.ctx, args.steps)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        loads.append(os.getloadavg()[0])
        decode[str(r)] = {"median_s": med, "times_s": times}
        print(f"{r} rows at {args.ctx} tokens: {args.dtype} KV {med['dtype'] * 1e3:.1f} ms, int8 KV "
              f"{med['int8'] * 1e3:.1f} ms a step: {med['dtype'] / med['int8']:.2f}x", flush=True)

    from engine import EngineConfig, LLMEngine

    tok = engines["int8"].tokenizer
    outs = chat_greedy(engines, lambda: LLMEngine(EngineConfig(model=args.model, dtype="float32", num_kv_blocks=blocks)),
                       args.agree_tokens)
    agree = {name: agreement(outs[name], outs["dtype"]) for name in ("int8", "float32")}
    print(f"greedy agreement with {args.dtype} KV: int8 KV {agree['int8']}, fp32 {agree['float32']}", flush=True)
    ppl = perplexities(model_dir, args.dtype, held_out_ids(tok, args.ppl_tokens), args.window)
    path = write_json(args.json_out, prov, args=vars(args), kernels=loaded_variant(), model=model_dir,
                      block_bytes=block_bytes, decode=decode, perplexity=ppl, agreement=agree,
                      agree_prompts=len(CHAT), loadavg_range=[min(loads), max(loads)])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
