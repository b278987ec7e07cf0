"""Single-stream output tok/s with and without n-gram speculation (engine/speculative.py).

    python -m bench.engine.speculative [--model default] [--dtype auto] [--k 4] [--ngram-min 2]
                                [--ngram-max 4] [--max-tokens 256] [--threads N]

Workloads, each request alone in an in-process LLMEngine, greedy, ending at EOS or
--max-tokens: `edit` (rewrite a ~1.5k-token document, docs/ENGINE.md's head, with one word
replaced), `summarize` (the same document), `chat` (three open questions) and `json` (two
requests for records under a JSON schema, structured output: the grammar's forced tokens are
the drafts where it has them, n-grams elsewhere). Two engines
(speculation off, on) alternate request by request, so a shared host's load falls on both.
Per workload: output tokens / request time (prefill included) and / decode time (after the
first token), the ratio on/off, the drafts' acceptance, and whether the tokens were the
same (greedy output must be). The one-row decode bound (every weight read once at the
measured read bandwidth, bench.engine.roofline) puts each rate against the hardware; speculation
can pass it, since a verified step emits several tokens for one weight read.
Writes --json-out (bench/results/speculative.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

CHAT = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how vaccines train the immune system, for a ten-year-old.",
        "Give me ten ideas for a rainy-day birthday party and say why each works."]


def document(chars: int = 6000) -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "ENGINE.md").read_text()
    return text[:chars]


def grounded_messages() -> dict[str, str]:
    """The input-grounded user messages by workload: `edit` asks for `document()` back with
    one word replaced, `summarize` for its summary (bench.peers sends the same texts)."""
    doc = document()
    return {"edit": "Rewrite the following document exactly as it is, but replace the word 'sequence' with "
                    f"'request' everywhere.\n\n{doc}",
            "summarize": f"Summarize the following document in a few paragraphs.\n\n{doc}"}


JSON_ASKS = ["List eight planets of the solar system as JSON records with their name, their order from the sun "
             "and whether they have rings.",
             "Give six fruits as JSON records with their name, their usual color and whether they are citrus."]
JSON_SCHEMA = json.dumps({"type": "object", "properties": {"records": {"type": "array", "minItems": 4, "maxItems": 8, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "position": {"type": "integer"},
                                     "color": {"type": "string", "maxLength": 16}, "flag": {"type": "boolean"}},
    "required": ["name", "position", "color", "flag"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False})


def workloads(tokenizer, max_tokens: int) -> dict[str, list[list[int]]]:
    def chat(msg: str) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return {**{name: [chat(text)] for name, text in grounded_messages().items()},
            "chat": [chat(m) for m in CHAT], "json": [chat(m) for m in JSON_ASKS]}


def one(engine, rid: str, prompt: list[int], params) -> dict:
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            tokens += out.new_token_ids
    end = time.perf_counter()
    return {"tokens": tokens, "total_s": end - start, "decode_s": end - (first or end)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--only", default=None, help="comma-separated workloads (default: all)")
    p.add_argument("--json-out", default="bench/results/speculative.json")
    args = p.parse_args(argv)

    import torch

    from bench.provenance import finish, provenance

    prov = provenance("engine.speculative", argv)
    from bench.engine.roofline import WEIGHT_BYTES, Rates, Shapes, cpu_info, decode_step_s, read_bandwidth
    from engine import EngineConfig, Grammar, LLMEngine, SamplingParams
    from engine.models import resolve_model

    torch.set_num_threads(args.threads)
    common = dict(model=args.model, dtype=args.dtype, kv_cache_memory_gb=0.5)
    engines = {"off": LLMEngine(EngineConfig(**common)),
               "on": LLMEngine(EngineConfig(**common, num_speculative_tokens=args.k,
                                            speculative_ngram_min=args.ngram_min, speculative_ngram_max=args.ngram_max))}
    dtype = str(engines["on"].runner.dtype).removeprefix("torch.")
    shapes = Shapes.from_config(json.loads((Path(resolve_model(args.model)) / "config.json").read_text()))
    bandwidth = read_bandwidth(512, 10)
    bound = 1.0 / decode_step_s(shapes, Rates(flops=float("inf"), bandwidth=bandwidth), 1, WEIGHT_BYTES[dtype])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    only = set(args.only.split(",")) if args.only else None
    rows = []
    print(f"{cpu_info()['model']}, {args.threads} threads, {dtype}; read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"one-row decode bound {bound:.1f} tok/s; load {os.getloadavg()[0]:.1f}")
    print("| workload | prompt tok | output tok | off tok/s (decode) | on tok/s (decode) | on/off | accepted / drafted | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, reqs in workloads(engines["on"].tokenizer, args.max_tokens).items():
        if only and name not in only:
            continue
        res = {"off": [], "on": []}
        before = dict(engines["on"].stats())
        req_params = params if name != "json" else dataclasses.replace(params, grammar=Grammar("json_schema", JSON_SCHEMA))
        for i, prompt in enumerate(reqs):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                res[mode].append(one(engines[mode], f"{name}-{i}-{mode}", prompt, req_params))
        after = engines["on"].stats()
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        n = sum(len(r["tokens"]) for r in res["off"])
        rate = {m: (n / sum(r["total_s"] for r in res[m]),
                    sum(len(r["tokens"]) - 1 for r in res[m]) / sum(r["decode_s"] for r in res[m])) for m in res}
        same = all(a["tokens"] == b["tokens"] for a, b in zip(res["off"], res["on"]))
        row = {"workload": name, "prompt_tokens": [len(q) for q in reqs], "output_tokens": n, "off_tok_s": rate["off"],
               "on_tok_s": rate["on"], "speedup_decode": rate["on"][1] / rate["off"][1], "drafted": drafted,
               "accepted": accepted, "same_tokens": same, "bound_tok_s": bound, "load": os.getloadavg()[0]}
        rows.append(row)
        print(f"| {name} | {'/'.join(map(str, row['prompt_tokens']))} | {n} | {rate['off'][0]:.1f} ({rate['off'][1]:.1f}, "
              f"{rate['off'][1] / bound:.0%}) | {rate['on'][0]:.1f} ({rate['on'][1]:.1f}, {rate['on'][1] / bound:.0%}) | "
              f"{row['speedup_decode']:.2f}x | {accepted} / {drafted} | {same} |", flush=True)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": finish(prov), "args": vars(args), "host": platform.node(),
                               "cpu": cpu_info()["model"],
                               "dtype": dtype, "bandwidth": bandwidth, "rows": rows}, indent=1))
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
