"""int8 weight-only linears (engine/quantization.py) against bf16: speed, bytes, accuracy.

    python -m bench.engine.int8 [--model default] [--steps 40] [--ctx 256] [--prefill-reps 3]
                         [--threads N] [--ppl-tokens 4096] [--window 512] [--agree-tokens 64] [--elastic]

- decode: two in-process engines on the same model, bf16 and bf16 + `quantization="int8"`,
  each decoding one sequence (a `--ctx`-token prompt); their steps alternate (the order
  flips every round), so a shared host's load falls on both. Median step, the ratio of
  medians and the median of the per-round ratios; the load average per round. On OpenMP,
  as engines run in process, or with `--elastic` on the kernels' elastic pool, as served.
- prefill: one `--window`-token prompt's prefill step (one chunk: many rows, so int8
  dequantizes each layer into its scratch buffer), alternating, `--prefill-reps` times.
- bytes: the linear weights' bytes in bf16 (each engine packs a tied lm_head as its own
  copy) against the int8 codes + scales + biases, and the scratch buffer.
- perplexity: fp32, bf16 and int8 (transformers' forward with `Int8Linear` layers, bf16
  activations) on held-out text (README.md then docs/ENGINE.md, the first `--ppl-tokens`
  tokens, in windows of `--window`).
- greedy agreement: six chat prompts, `--agree-tokens` tokens each, greedy, on the bf16,
  int8 and fp32 engines: the share of tokens before the first difference (and of equal
  positions), int8 and fp32 each against bf16.
Writes --json-out (bench/results/int8.json); `python -m bench report` renders it (§10).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHAT = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how vaccines train the immune system, for a ten-year-old.",
        "Give me ten ideas for a rainy-day birthday party and say why each works.",
        "What are the main differences between TCP and UDP?",
        "Summarize the plot of Romeo and Juliet in five sentences.",
        "How do I make a simple tomato sauce from scratch?"]


def _engine(model: str, dtype: str, blocks: int, **extra):
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=model, dtype=dtype, num_kv_blocks=blocks, max_num_batched_tokens=2048,
                                  enable_prefix_caching=False, **extra))


def decode_steps(engines: dict, ctx: int, steps: int) -> dict:
    """Alternating one-row decode steps; per engine the step times, and the load per round."""
    import random

    from engine import SamplingParams

    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(ctx)]
    for name, eng in engines.items():
        eng.add_request(f"decode-{name}", prompt, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
        while eng.stats()["waiting"] or any(s.is_prefill for s in eng.scheduler.running):
            eng.step()
        eng.step()                                                      # one warm decode step
    times: dict[str, list[float]] = {name: [] for name in engines}
    loads = []
    for i in range(steps):
        for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
            start = time.perf_counter()
            engines[name].step()
            times[name].append(time.perf_counter() - start)
        loads.append(os.getloadavg()[0])
    for eng in engines.values():
        while eng.has_unfinished():
            eng.step()
    return {"times": times, "loads": loads}


def prefill_steps(engines: dict, tokens: int, reps: int) -> dict[str, list[float]]:
    """One `tokens`-token prompt's prefill step per engine, alternating, `reps` times."""
    import random

    from engine import SamplingParams

    rng = random.Random(1)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(reps):
        prompt = [rng.randrange(1000, 40000) for _ in range(tokens)]
        for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
            eng = engines[name]
            eng.add_request(f"prefill-{name}-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            start = time.perf_counter()
            eng.step()
            times[name].append(time.perf_counter() - start)
            while eng.has_unfinished():
                eng.step()
    return times


def weight_bytes(model_dir: str, int8_engine) -> dict:
    """bf16 bytes of every linear weight (lm_head counted: the engine packs its own copy), the
    int8 engine's codes + scales + biases, and its scratch buffers."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from engine import quantization

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    bf16 = sum(m.weight.numel() * 2 + (0 if m.bias is None else m.bias.numel() * 2)
               for m in model.modules() if type(m) is nn.Linear)
    layers = list(int8_engine.runner.forward.layers) if hasattr(int8_engine.runner.forward, "layers") else []
    weights = [getattr(layer, a).packed for layer in layers for a in ("qkv", "o", "gate_up", "down")]
    weights.append(int8_engine.runner.forward.lm_head.packed)
    int8 = sum(w.nbytes for w in weights)
    scratch = sum(b.untyped_storage().nbytes() for b in getattr(quantization._scratch, "bufs", {}).values())
    return {"bf16": bf16, "int8": int8, "scratch": scratch, "largest_layer_elements":
            max(w.out_features * w.in_features for w in weights)}


def held_out_ids(tokenizer, tokens: int) -> list[int]:
    text = (ROOT / "README.md").read_text() + "\n\n" + (ROOT / "docs" / "ENGINE.md").read_text()
    ids = tokenizer(text)["input_ids"]
    if len(ids) < tokens:
        raise SystemExit(f"--ppl-tokens {tokens}: the held-out text has {len(ids)} tokens")
    return ids[:tokens]


def perplexity(model, ids: list[int], window: int) -> float:
    """exp(mean next-token NLL) over non-overlapping windows (each predicts its own tokens 2..)."""
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window]])
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).logits[0, :-1].float()
            nll += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def perplexities(model_dir: str, ids: list[int], window: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.quantization import quantize_linears

    out = {}
    for name, dtype, quantize in (("float32", torch.float32, False), ("bfloat16", torch.bfloat16, False),
                                  ("int8", torch.bfloat16, True)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if quantize:
            quantize_linears(model)
        out[name] = perplexity(model, ids, window)
        print(f"perplexity {name}: {out[name]:.3f}", flush=True)
        del model
    return out


def greedy(eng, prompts: list[list[int]], tokens: int, tag: str) -> list[list[int]]:
    from engine import SamplingParams

    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        got[f"{tag}-{i}"] = []
        eng.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    return [got[f"{tag}-{i}"] for i in range(len(prompts))]


def chat_greedy(engines: dict, make_fp32, tokens: int) -> dict[str, list[list[int]]]:
    """Greedy outputs of the CHAT prompts (chat template applied) on each engine, each closed
    after, then on the fp32 engine `make_fp32()` builds (once the others are closed)."""
    tok = next(iter(engines.values())).tokenizer
    prompts = []
    for msg in CHAT:
        ids = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    outs = {name: greedy(eng, prompts, tokens, name) for name, eng in engines.items()}
    for eng in engines.values():
        eng.close()
    fp32 = make_fp32()
    outs["float32"] = greedy(fp32, prompts, tokens, "float32")
    fp32.close()
    return outs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Share of tokens before the first difference, and share of equal positions."""
    total = sum(len(x) for x in a)
    prefix = sum(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))) for x, y in zip(a, b))
    same = sum(s == t for x, y in zip(a, b) for s, t in zip(x, y))
    return {"prefix": prefix / total, "positions": same / total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--steps", type=int, default=40, help="decode rounds (one step of each engine per round)")
    p.add_argument("--ctx", type=int, default=256, help="the decoding sequence's prompt tokens")
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512, help="perplexity window and prefill chunk (tokens)")
    p.add_argument("--agree-tokens", type=int, default=64)
    p.add_argument("--elastic", action="store_true",
                   help="both engines on the kernels' elastic pool, as served (engine/elastic.py); default OpenMP, "
                        "as in process")
    p.add_argument("--json-out", default="bench/results/int8.json")
    args = p.parse_args(argv)

    import torch

    from bench.provenance import provenance, write_json
    from engine.kernels import loaded_variant
    from engine.models import resolve_model

    prov = provenance("engine.int8", argv)
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    blocks = (max(args.ctx + args.steps, args.window) + 64) // 16 * len(CHAT) + 64
    pool = {"elastic_threads": True} if args.elastic else {}
    engines = {"bfloat16": _engine(args.model, "bfloat16", blocks, **pool),
               "int8": _engine(args.model, "bfloat16", blocks, quantization="int8", **pool)}
    pool_name = " (elastic pool)" if args.elastic else ""
    print(f"kernels: {loaded_variant()}, {args.threads} threads{pool_name}; load {os.getloadavg()[0]:.1f}", flush=True)

    dec = decode_steps(engines, args.ctx, args.steps)
    med = {name: statistics.median(ts) for name, ts in dec["times"].items()}
    paired = statistics.median(b / q for b, q in zip(dec["times"]["bfloat16"], dec["times"]["int8"]))
    print(f"one-row decode step: bf16 {med['bfloat16'] * 1e3:.1f} ms, int8 {med['int8'] * 1e3:.1f} ms: "
          f"{med['bfloat16'] / med['int8']:.2f}x (paired {paired:.2f}x); load {min(dec['loads']):.1f}-"
          f"{max(dec['loads']):.1f}", flush=True)
    pre = prefill_steps(engines, args.window, args.prefill_reps)
    pre_med = {name: statistics.median(ts) for name, ts in pre.items()}
    print(f"{args.window}-token prefill step: bf16 {pre_med['bfloat16'] * 1e3:.0f} ms, int8 "
          f"{pre_med['int8'] * 1e3:.0f} ms", flush=True)
    nbytes = weight_bytes(model_dir, engines["int8"])
    print(f"linear weights: bf16 {nbytes['bf16'] / 1e6:.1f} MB, int8 {nbytes['int8'] / 1e6:.1f} MB "
          f"+ scratch {nbytes['scratch'] / 1e6:.1f} MB", flush=True)

    tok = engines["int8"].tokenizer
    outs = chat_greedy(engines, lambda: _engine(args.model, "float32", blocks), args.agree_tokens)
    agree = {name: agreement(outs[name], outs["bfloat16"]) for name in ("int8", "float32")}
    print(f"greedy agreement with bf16: int8 {agree['int8']}, fp32 {agree['float32']}", flush=True)

    ppl = perplexities(model_dir, held_out_ids(tok, args.ppl_tokens), args.window)
    path = write_json(args.json_out, prov, args=vars(args), kernels=loaded_variant(), model=model_dir,
                      decode={"median_s": med, "paired_speedup": paired, "times_s": dec["times"]},
                      prefill={"median_s": pre_med, "times_s": pre}, weight_bytes=nbytes,
                      perplexity=ppl, agreement=agree, agree_prompts=len(CHAT),
                      loadavg_range=[min(dec["loads"]), max(dec["loads"])])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
