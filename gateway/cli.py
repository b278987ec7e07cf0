"""The `streamgate` command.

    streamgate serve [--tenants FILE] [...]     serve chat over HTTP/SSE and WebSocket
    streamgate keys new TENANT                  print a fresh API key and its tenants-file line
    streamgate chat "Why is the sky blue?"      stream an answer to the terminal

The benchmarks have their own command, `streamgate-bench NAME [...]` (bench/__main__.py);
`streamgate bench NAME` still runs it, with a deprecation line, in a process of its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from .cli_limits import limit_args as _limit_args
from .cli_limits import server_limits, settings_limits


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a local HF dir or a hub id")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bfloat16 on CUDA and on CPUs with AMX-bf16, else float32")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "kernel", "torch"],
                   help="auto: the C++ paged attention kernel on CPU where it builds, else gather + SDPA")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (start-up takes minutes)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="with --compile on CUDA: run decode steps compiled but without CUDA graphs")
    p.add_argument("--no-packed-linear", action="store_true",
                   help="CPU fp32: torch's linear layers instead of the packed C++ kernel (and no fused forward)")
    p.add_argument("--no-fused-layers", action="store_true",
                   help="CPU fp32 Llama: transformers' forward instead of the fused one")
    p.add_argument("--no-adaptive-threads", action="store_true",
                   help="CPU: every step on all torch threads (default: small steps on one thread when measured faster)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N ranks (processes; one GPU each on CUDA, gloo on CPU)")
    p.add_argument("--tp-timeout", type=float, default=30.0,
                   help="seconds a tensor-parallel collective may wait before the engine fails")
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8 weight-only linear layers (CPU; see engine/quantization.py)")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="speculative decoding with n-gram (prompt-lookup) proposals: tokens proposed a "
                        "step per sequence (0: off; see engine/speculative.py)")
    p.add_argument("--speculative-ngram-min", type=int, default=2, help="shortest n-gram matched for proposals")
    p.add_argument("--speculative-ngram-max", type=int, default=4, help="longest n-gram matched for proposals")


def chat(args: argparse.Namespace) -> int:
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    attention_backend=args.attention_backend, compile=args.compile,
                                    cuda_graphs=not args.no_cuda_graphs,
                                    packed_linear=False if args.no_packed_linear else None,
                                    fused_layers=False if args.no_fused_layers else None,
                                    tensor_parallel_size=args.tensor_parallel_size, tp_timeout_s=args.tp_timeout,
                                    quantization=args.quantization, **_speculative(args)))
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(prompt, "keys"):
        prompt = prompt["input_ids"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    start = time.perf_counter()
    first = None
    engine.add_request("chat", list(prompt), params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - start
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                elapsed = time.perf_counter() - start
                n = out.num_output_tokens
                rate = (n - 1) / (elapsed - first) if n > 1 and first is not None and elapsed > first else 0.0
                print(f"\n\n[{n} tokens, finish_reason={out.finish_reason}, TTFT {first or 0:.2f} s, "
                      f"{rate:.1f} tokens/s]", file=sys.stderr)
    engine.close()
    return 0


def _scheduling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "priority", "cost", "fair"])
    p.add_argument("--preemption-mode", default="auto", choices=["auto", "recompute", "swap"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--num-swap-blocks", type=int, default=0)
    p.add_argument("--no-chunked-prefill", action="store_true", help="prefill-first, unchunked (comparison)")
    p.add_argument("--batching", default="continuous", choices=["continuous", "static"],
                   help="static: request-level batches (comparison)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--preempt-at-admission", default="auto", choices=["auto", "on", "off"],
                   help="let an arrival preempt running sequences (auto: on for --policy priority "
                        "and fair, by seat share)")
    p.add_argument("--itl-target-ms", type=float, default=0.0,
                   help="let a step grow past --max-num-batched-tokens while its measured time stays "
                        "under this (0: fixed budget)")
    p.add_argument("--max-step-tokens", type=int, default=4096, help="cap on an adaptive step's tokens")
    p.add_argument("--seat-quantum-steps", type=int, default=2,
                   help="steps a sequence runs after (re)admission before it may lose its seat")
    p.add_argument("--max-seat-preemptions", type=int, default=2,
                   help="times a sequence may lose its seat to an arrival")
    p.add_argument("--fair-burst-tokens", type=int, default=1024,
                   help="fair: service a light tenant may bank for its bursts (0: VTC's own lift)")
    p.add_argument("--isolate-prompts", default="on", choices=["on", "off"],
                   help="priority: a less urgent class's prompts wait a step rather than share a more "
                        "urgent class's prompt's step")
    p.add_argument("--yielding-prompt-tokens", type=int, default=64,
                   help="prompt tokens a step for prompts that yield (priority: less urgent classes "
                        "while a more urgent one has arrived in the last minute; fair: a tenant served "
                        "ahead of another that has) (0: off)")


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig that `_engine_args` + `_scheduling_args` flags describe."""
    from engine import EngineConfig

    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                        attention_backend=args.attention_backend, compile=args.compile,
                        cuda_graphs=not args.no_cuda_graphs, policy=args.policy,
                        packed_linear=False if args.no_packed_linear else None,
                        fused_layers=False if args.no_fused_layers else None,
                        adaptive_threads=not args.no_adaptive_threads,
                        tensor_parallel_size=args.tensor_parallel_size, tp_timeout_s=args.tp_timeout,
                        quantization=args.quantization, preemption_mode=args.preemption_mode, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        num_kv_blocks=args.num_kv_blocks, num_swap_blocks=args.num_swap_blocks,
                        chunked_prefill=not args.no_chunked_prefill, batching=args.batching,
                        enable_prefix_caching=not args.no_prefix_caching,
                        preempt_for_priority={"auto": None, "on": True, "off": False}[args.preempt_at_admission],
                        itl_target_ms=args.itl_target_ms or None, max_step_tokens=args.max_step_tokens,
                        seat_quantum_steps=args.seat_quantum_steps, max_seat_preemptions=args.max_seat_preemptions,
                        fair_burst_tokens=args.fair_burst_tokens, isolate_prompts=args.isolate_prompts == "on",
                        yielding_prompt_tokens=args.yielding_prompt_tokens, **_speculative(args))


def _speculative(args: argparse.Namespace) -> dict:
    return dict(num_speculative_tokens=args.num_speculative_tokens, speculative_ngram_min=args.speculative_ngram_min,
                speculative_ngram_max=args.speculative_ngram_max)


def serve(args: argparse.Namespace) -> int:
    from tenants import TenantConfigError

    from .app import GatewaySettings, create_app
    from .logs import configure_logging
    from .server import serve as run_server

    configure_logging()
    try:
        engine = engine_config_from_args(args)
        settings = GatewaySettings(engine=engine, tenants_file=args.tenants, ledger_path=args.ledger,
                                   redis_url=args.redis or None, redis_lease_ttl_s=args.redis_lease_ttl,
                                   allowed_origins=tuple(args.allow_origin), drain_grace_s=args.drain_grace,
                                   **settings_limits(args))
        app = create_app(settings)
    except (ValueError, TenantConfigError) as exc:
        print(f"streamgate: {exc}", file=sys.stderr)
        return 2
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"streamgate: serving on http://{shown}:{args.port}/  (demo page; API at /v1, health at /health)",
          file=sys.stderr, flush=True)
    run_server(app, args.host, args.port, **server_limits(args))
    return 0


def keys(args: argparse.Namespace) -> int:
    from tenants import hash_key, new_key

    key = new_key()
    print(f"API key for tenant {args.tenant!r} (shown once; store it in a secret manager):\n\n  {key}\n")
    print("Add its hash to your tenants file:\n")
    print(f"[tenants.{args.tenant}]")
    print(f'api_key_sha256 = ["{hash_key(key)}"]')
    return 0


def bench(args: argparse.Namespace, rest: list[str]) -> int:
    """The old spelling of `streamgate-bench NAME`, kept one release: the benchmark runs in its
    own process, so the gateway never imports bench/."""
    import subprocess

    logging.getLogger("streamgate").warning("`streamgate bench %s` is deprecated: use `streamgate-bench %s`",
                                            args.which, args.which)
    return subprocess.call([sys.executable, "-m", "bench", args.which, *rest])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamgate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_chat = sub.add_parser("chat", help="stream one answer to the terminal")
    p_chat.add_argument("prompt")
    _engine_args(p_chat)
    p_chat.add_argument("--system", default=None, help="system message")
    p_chat.add_argument("--max-tokens", type=int, default=256)
    p_chat.add_argument("--temperature", type=float, default=0.7)
    p_chat.add_argument("--top-p", type=float, default=0.9)
    p_chat.add_argument("--seed", type=int, default=None)
    p_serve = sub.add_parser("serve", help="serve chat over HTTP/SSE and WebSocket")
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument("--tenants", default="examples/tenants.toml", help="tenants TOML file (see docs/PROTOCOL.md)")
    p_serve.add_argument("--ledger", default=None, help="SQLite file for daily token budgets "
                         "(default ~/.cache/streamgate/usage.sqlite3); with --redis, for settlements "
                         "not yet in Redis (default ~/.cache/streamgate/quota-outbox.sqlite3)")
    p_serve.add_argument("--redis", default=os.environ.get("STREAMGATE_REDIS_URL"), metavar="URL",
                         help="share quotas, leases and daily budgets with other replicas in Redis, "
                              "e.g. redis://10.0.0.5:6379/0 (env STREAMGATE_REDIS_URL; default: embedded)")
    p_serve.add_argument("--redis-lease-ttl", type=float, default=10.0,
                         help="seconds after which a dead replica's concurrency leases are freed")
    p_serve.add_argument("--allow-origin", action="append", default=[],
                         help="browser Origin allowed on the WebSocket (repeatable; default: same host only)")
    p_serve.add_argument("--drain-grace", type=float, default=30.0, help="seconds running streams get on SIGTERM")
    _limit_args(p_serve)
    _engine_args(p_serve)
    _scheduling_args(p_serve)
    p_keys = sub.add_parser("keys", help="API keys")
    p_keys.add_argument("action", choices=["new"])
    p_keys.add_argument("tenant")
    p_bench = sub.add_parser("bench", help="benchmarks (see bench/)")
    p_bench.add_argument("which", choices=["offline", "scheduling", "profile_decode", "gateway_overhead", "serve",
                                                  "isolation"])
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command in ("serve", "keys") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        return serve(args)
    if args.command == "keys":
        return keys(args)
    if args.command == "chat":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        try:
            return chat(args)
        except ValueError as exc:
            print(f"streamgate: {exc}", file=sys.stderr)
            return 2
    return bench(args, rest)


if __name__ == "__main__":
    sys.exit(main())
