"""The `streamgate` command.

    streamgate chat "Why is the sky blue?"      stream an answer to the terminal
    streamgate bench offline [...]              the offline throughput benchmark
    streamgate bench scheduling smoothness      decode smoothness / preemption cost
    streamgate bench profile_decode             where a decode step's time goes
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a local HF dir or a hub id")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")


def chat(args: argparse.Namespace) -> int:
    from engine import EngineConfig, LLMEngine, SamplingParams

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=dtype))
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
    return 0


def bench(args: argparse.Namespace, rest: list[str]) -> int:
    import importlib

    module = importlib.import_module(f"bench.{args.which}")    # argparse limited the choices
    return module.main(rest) or 0


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
    p_bench = sub.add_parser("bench", help="benchmarks (see bench/)")
    p_bench.add_argument("which", choices=["offline", "scheduling", "profile_decode"])
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
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
