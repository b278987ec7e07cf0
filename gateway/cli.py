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

from engine.config_cli import add_engine_args, engine_config_from_args

from .cli_limits import limit_args as _limit_args
from .cli_limits import server_limits, settings_limits


def chat(args: argparse.Namespace) -> int:
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
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


def _gateway_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--tenants", default="examples/tenants.toml", help="tenants TOML file (see docs/PROTOCOL.md)")
    g.add_argument("--ledger", default=None, help="SQLite file for daily token budgets "
                   "(default ~/.cache/streamgate/usage.sqlite3); with --redis, for settlements "
                   "not yet in Redis (default ~/.cache/streamgate/quota-outbox.sqlite3)")
    g.add_argument("--redis", default=os.environ.get("STREAMGATE_REDIS_URL"), metavar="URL",
                   help="share quotas, leases and daily budgets with other replicas in Redis, "
                        "e.g. redis://10.0.0.5:6379/0 (env STREAMGATE_REDIS_URL; default: embedded)")
    g.add_argument("--redis-lease-ttl", type=float, default=10.0,
                   help="seconds after which a dead replica's concurrency leases are freed")
    g.add_argument("--allow-origin", action="append", default=[],
                   help="browser Origin allowed on the WebSocket (repeatable; default: same host only)")
    g.add_argument("--drain-grace", type=float, default=30.0, help="seconds running streams get on SIGTERM")


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
                                   freeze_gc=True, **settings_limits(args))
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


def build_parser() -> argparse.ArgumentParser:
    """The `streamgate` parser: `serve` and `chat` take the engine flags add_engine_args generates."""
    parser = argparse.ArgumentParser(prog="streamgate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_chat = sub.add_parser("chat", help="stream one answer to the terminal")
    p_chat.add_argument("prompt")
    sampling = p_chat.add_argument_group("sampling")
    sampling.add_argument("--system", default=None, help="system message")
    sampling.add_argument("--max-tokens", type=int, default=256)
    sampling.add_argument("--temperature", type=float, default=0.7)
    sampling.add_argument("--top-p", type=float, default=0.9)
    sampling.add_argument("--seed", type=int, default=None)
    add_engine_args(p_chat)
    p_serve = sub.add_parser("serve", help="serve chat over HTTP/SSE and WebSocket")
    _gateway_args(p_serve.add_argument_group("gateway", "where it listens, who may call it, where usage is kept"))
    _limit_args(p_serve)
    add_engine_args(p_serve)
    p_keys = sub.add_parser("keys", help="API keys")
    p_keys.add_argument("action", choices=["new"])
    p_keys.add_argument("tenant")
    p_bench = sub.add_parser("bench", help="benchmarks (see bench/)")
    p_bench.add_argument("which", choices=["offline", "scheduling", "profile_decode", "gateway_overhead", "serve",
                                                  "isolation"])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)            # before parsing: old flag spellings log a deprecation line
    for noisy in ("httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args, rest = parser.parse_known_args(argv)
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
