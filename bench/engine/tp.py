"""Tensor parallelism: TP=1 against TP=N step times, and the communication share of a step.

    python -m bench.engine.tp                                          # CPU: TP=1 (1 and 2 threads), TP=2
    python -m bench.engine.tp --device cuda --dtype bfloat16 --tp 1,2,4 --layers 16   # GPUs, NCCL

SmolLM2-135M has 9 query and 3 KV heads: it divides by neither 2 nor 4, so by default the
benchmark builds a random Llama of realistic width (TinyLlama-1.1B's layer: hidden 2048,
16 heads, 8 KV heads, FFN 5632) with few layers and a small vocabulary (what a step
spends per layer is the point; `--model DIR` takes any local Llama/Qwen2/Qwen3 instead).

Per TP size, B sequences of P-token prompts: the prefill step (all B prompts in one step)
and the mean decode step (B tokens). Then a profiled window of decode steps on rank 0:
the time inside collectives (gloo/NCCL all_reduce after o_proj and down_proj, all_gather
of the logits, the step broadcast) over the window's wall time, and the floor under it: the
median of 50 idle round trips (a broadcast + a one-number all_reduce, the heartbeat's
ping) while no rank computes. On CPU a run is `N@T`:
N ranks sharing T threads (T / N each), so TP=2 on 2 cores is compared with TP=1 on one
core and on both.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config_cli import add_engine_args


def build_model(out: str, args: argparse.Namespace) -> str:
    """A random Llama of the given shape, saved with the default model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.models import resolve_model

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve_model("default")).save_pretrained(out)
    return out


def _collective_seconds(prof, device: str) -> float:
    """Time inside collectives: gloo's record functions on CPU; NCCL kernels' device time on CUDA."""
    total = 0.0
    for ev in prof.key_averages():
        if ev.key.startswith("gloo:"):
            total += ev.cpu_time_total / 1e6
        elif device == "cuda" and "nccl" in ev.key.lower():
            total += ev.device_time_total / 1e6
    return total


def measure(model: str, tp: int, threads: int, args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    b, p = args.batch, args.prompt
    engine = LLMEngine(EngineConfig(model=model, device=args.device, dtype=args.dtype, tensor_parallel_size=tp,
                                    max_num_seqs=b, max_num_batched_tokens=max(512, b * p),
                                    kv_cache_memory_gb=args.kv_gb, tp_timeout_s=120.0))
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)

    def add(tag: str) -> None:
        for i in range(b):
            engine.add_request(f"{tag}{i}", [(7 + 31 * i + 3 * j) % vocab for j in range(p)], params)

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    try:
        add("w")                                          # warm-up: one full round
        while engine.has_unfinished():
            engine.step()
        add("m")
        prefill = timed_step()
        channel = getattr(engine.runner, "channel", None)
        sent = channel.seconds if channel else 0.0
        decode = [timed_step() for _ in range(args.new - 1)]
        broadcast = (channel.seconds - sent) if channel else 0.0
        add("p")
        engine.step()                                     # the profiled window is decode steps only
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(args.profile_steps):
                engine.step()
            window = time.perf_counter() - start
        comm = _collective_seconds(prof, args.device)
        # The floor: a broadcast + all_reduce round trip while the other ranks wait idle.
        pings = sorted(engine.runner.ping() for _ in range(50)) if tp > 1 else [0.0]
    finally:
        engine.close()
    return {"tp": tp, "threads": threads,
            "prefill_step_ms": prefill * 1e3, "decode_step_ms": 1e3 * sum(decode) / len(decode),
            "broadcast_share": broadcast / sum(decode), "comm_share_profiled": comm / window,
            "profiled_step_ms": 1e3 * window / args.profile_steps, "ping_p50_ms": 1e3 * pings[len(pings) // 2],
            "collectives_per_step": 2 * engine.runner.model.config.num_hidden_layers + 1 if tp > 1 else 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", default=None, help="comma-separated runs N or N@T: N ranks sharing T CPU threads "
                   "(default on CPU: 1@1,1@2,2@2; on CUDA: 1,2)")
    add_engine_args(p, only=("device", "dtype"))
    p.add_argument("--model", default=None, help="a local model directory (default: a random Llama, below)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=16, help="decode steps measured")
    p.add_argument("--profile-steps", type=int, default=6)
    p.add_argument("--kv-gb", type=float, default=0.25, help="KV pool per rank (GiB)")
    p.add_argument("--json-out", default="bench/results/tp.json")
    args = p.parse_args(argv)
    from bench.provenance import provenance, write_json

    prov = provenance("engine.tp", argv)
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        model = args.model or build_model(tmp, args)
        runs = [(run + "@" + str(os.cpu_count() or 1)).split("@")[:2]
                for run in (args.tp or ("1@1,1@2,2@2" if args.device == "cpu" else "1,2")).split(",")]
        rows = [measure(model, int(tp), int(threads), args) for tp, threads in runs]
    print(f"{'TP':>3} {'threads':>7} {'prefill ms':>11} {'decode ms':>10} {'vs first':>8} {'broadcast':>10} "
          f"{'collectives':>12} {'ping ms':>8}")
    for row in rows:
        print(f"{row['tp']:>3} {row['threads']:>7} {row['prefill_step_ms']:>11.1f} {row['decode_step_ms']:>10.1f} "
              f"{row['decode_step_ms'] / rows[0]['decode_step_ms']:>7.2f}x {row['broadcast_share']:>10.1%} "
              f"{row['comm_share_profiled']:>12.1%} {row['ping_p50_ms']:>8.2f}")
    write_json(args.json_out, prov, args=vars(args), rows=rows, torch=torch.__version__)
    print(f"wrote {args.json_out}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
