"""What constrained decoding costs (issue 27): the per-step work constrained rows add, decode
steps with 0, 1 and all streams under a JSON schema, and grammar compile times.

    python -m bench.engine.grammar [--model default] [--rows 32] [--reps 50]
                            [--decode] [--streams 8,32] [--steps 40] [--rounds 2] [--dtype auto]
    python -m bench.engine.grammar --n [--rounds 2]     # n=4 against 4 separate requests

Default (no model forward, on one torch thread, so a shared host's load disturbs it least):
32 sampling rows of the model's vocabulary, after 30 constrained tokens each; the median time
of the mask work (llguidance fills the step's bitmask on a pool thread, overlapped with the
forward in the engine; numpy unpacks it) and of `sample_step` with 0, 1 and all rows
constrained, interleaved.
`--decode`: phases of `--steps` pure decode steps of the model with 0, 1 and all streams
constrained, in turn, `--rounds` times (alternating phases share the host's load); the
constrained rows sample under a schema that cannot end within the phase (an array of at least
200 objects), the others ignore EOS. Compile times: `Grammar.check()` (the admission check, on
the caller's thread) and the token-level compile for a small and a large schema. Writes
--json-out (bench/results/grammar.json); `--roofline PATH` embeds this host's roofline so the
report states each decode step as a fraction of its bound.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine import EngineConfig, Grammar, LLMEngine, SamplingParams
from engine.grammar_runtime import GrammarRuntime
from engine.sampler import sample_step
from engine.sequence import Sequence
from engine.config_cli import add_engine_args

LONG = {"type": "array", "minItems": 200, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "n", "kind"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0},
                   "kind": {"enum": ["a", "b", "c"]}}}}
SMALL = {"type": "object", "additionalProperties": False, "required": ["city", "temp"],
         "properties": {"city": {"type": "string"}, "temp": {"type": "number"}, "unit": {"enum": ["C", "F"]}}}


def large_schema(n: int = 120) -> dict:
    """n properties of mixed kinds, nested objects and $refs: ~20 KB of JSON."""
    rng = random.Random(0)
    item = {"type": "object", "required": ["id"],
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10**6},
                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                           "mode": {"enum": [f"m{j}" for j in range(12)]}}}
    defs = {f"t{i}": item for i in range(10)}
    props = {}
    for i in range(n):
        props[f"field_{i}"] = rng.choice([{"type": "string", "maxLength": 40}, {"type": "number", "minimum": -1e3,
                                          "maximum": 1e3}, {"$ref": f"#/$defs/t{i % 10}"}, {"type": "boolean"},
                                          {"type": "array", "items": {"$ref": f"#/$defs/t{(i + 3) % 10}"}}])
    return {"type": "object", "properties": props, "required": sorted(props)[: n // 2], "$defs": defs}


def decode_phase(engine: LLMEngine, streams: int, constrained: int, steps: int, tag: int) -> tuple[float, float]:
    rng = random.Random(tag)
    grammar = Grammar("json_schema", json.dumps(LONG))
    ids = []
    for i in range(streams):
        rid = f"{tag}-{i}"
        prompt = [rng.randrange(100, 40_000) for _ in range(128)]
        if i < constrained:
            params = SamplingParams(max_tokens=steps * 4, temperature=1.0, seed=i, grammar=grammar)
        else:
            params = SamplingParams(max_tokens=steps * 4, temperature=1.0, seed=i, ignore_eos=True)
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    while any(engine.seqs[r].num_output_tokens == 0 for r in ids):
        engine.step()
    times, forwards = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        forwards.append(engine.stats()["forward_time_s"])
        assert engine.stats()["num_decode_tokens"] == streams, "a stream ended inside the phase"
    for r in ids:
        engine.abort(r)
    engine.step()
    return statistics.median(times), statistics.median(forwards)


def micro(rt: GrammarRuntime, rows: int, reps: int) -> dict:
    vocab = rt.vocab_size
    gen = torch.Generator().manual_seed(0)
    grammar = Grammar("json_schema", json.dumps(LONG))
    sets = {}
    for constrained in (0, 1, rows):
        seqs = sets[constrained] = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(
            temperature=1.0, seed=i, grammar=grammar if i < constrained else None)) for i in range(rows)]
        for s in seqs[:constrained]:
            rt.start(s, 0.0)
            s.grammar_state.future.result()
            assert s.grammar_state.ready
        for _ in range(30):                      # move the matchers into the JSON
            logits = torch.randn(rows, vocab, generator=gen)
            job = rt.masks(seqs)
            tokens, _ = sample_step(logits, seqs, job and job.result())
            rt.advance(seqs, tokens)
            for s, t in zip(seqs, tokens):
                s.output_token_ids.append(t)
    fill: dict[int, list[float]] = {c: [] for c in sets}
    total: dict[int, list[float]] = {c: [] for c in sets}
    logits = torch.randn(rows, vocab, generator=gen)
    for _ in range(reps):                        # interleaved: the three share the host's load
        for constrained, seqs in sets.items():
            t0 = time.perf_counter()
            job = rt.masks(seqs)
            masks = job and job.result()
            t1 = time.perf_counter()
            sample_step(logits, seqs, masks)
            t2 = time.perf_counter()
            fill[constrained].append(t1 - t0)
            total[constrained].append(t2 - t0)
    out = {}
    for constrained in sets:
        f, t = statistics.median(fill[constrained]), statistics.median(total[constrained])
        print(f"{rows} rows, {constrained:2d} constrained: mask fill + unpack {f * 1e3:6.2f} ms, "
              f"with sampling {t * 1e3:6.2f} ms (median of {reps})")
        out[str(constrained)] = {"mask_ms": f * 1e3, "with_sampling_ms": t * 1e3}
    return out


def compile_times(engine: LLMEngine) -> dict:
    rt = engine.grammars
    out = {}
    for name, schema in (("small", SMALL), ("large", large_schema())):
        g = Grammar("json_schema", json.dumps(schema))
        t = time.perf_counter()
        g.check()
        check = time.perf_counter() - t
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            rt._compile(g)
            runs.append(time.perf_counter() - t)
        print(f"compile {name:5s} ({len(g.spec):6d} B): check {check * 1e3:7.2f} ms (first, uncached); "
              f"token-level compile {', '.join(f'{x * 1e3:.1f}' for x in runs)} ms")
        out[name] = {"bytes": len(g.spec), "check_ms": check * 1e3, "compile_ms": [x * 1e3 for x in runs]}
    return out


def n_choices(engine: LLMEngine, prompt_len: int, max_tokens: int, rounds: int) -> list[dict]:
    """n=4 (one prompt, four seeded choices, as the gateway sends them) against four
    requests with distinct prompts: wall time to complete all four, alternating."""
    times: dict[str, list[float]] = {"n=4": [], "4 requests": []}
    out = []
    for r in range(rounds):
        for kind in times:
            rng = random.Random(r)
            shared = [rng.randrange(100, 40_000) for _ in range(prompt_len)]
            before = engine.scheduler.counters.prompt_tokens
            start = time.perf_counter()
            for i in range(4):
                p = shared if kind == "n=4" else [rng.randrange(100, 40_000) for _ in range(prompt_len)]
                engine.add_request(f"n{r}-{kind}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                         seed=i, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            times[kind].append(time.perf_counter() - start)
            computed = engine.scheduler.counters.prompt_tokens - before
            took = times[kind][-1]
            print(f"{kind:10s} round {r}: {took:6.2f} s, {4 * max_tokens / took:6.1f} output tok/s, "
                  f"{computed} prompt tokens computed")
            out.append({"kind": kind, "round": r, "wall_s": took, "prompt_tokens_computed": computed})
    return out


def decode(engine: LLMEngine, streams_list: list[int], steps: int, rounds: int) -> list[dict]:
    """Decode phases with 0, 1 and all streams constrained, alternating, `rounds` times."""
    tag, out = 0, []
    for streams in streams_list:
        results: dict[int, list[tuple[float, float]]] = {}
        for _ in range(rounds):
            for constrained in (0, 1, streams):
                tag += 1
                results.setdefault(constrained, []).append(decode_phase(engine, streams, constrained, steps, tag))
        base = statistics.median(s for s, _ in results[0])
        for constrained, runs in results.items():
            step = statistics.median(s for s, _ in runs)
            fwd = statistics.median(f for _, f in runs)
            print(f"{streams:2d} streams, {constrained:2d} constrained: step {step * 1e3:6.2f} ms "
                  f"(forward {fwd * 1e3:6.2f} ms), {100 * (step / base - 1):+5.1f} % vs none "
                  f"[{', '.join(f'{s * 1e3:.2f}' for s, _ in runs)}]")
            out.append({"streams": streams, "constrained": constrained, "step_ms": step * 1e3, "forward_ms": fwd * 1e3,
                        "rounds_ms": [s * 1e3 for s, _ in runs], "prompt_tokens": 128})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, only=("model", "dtype"), defaults={"dtype": "auto"})
    ap.add_argument("--streams", default="8,32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--n", action="store_true", help="n=4 against 4 separate requests (prompt 1024, 32 tokens)")
    ap.add_argument("--roofline", help="a roofline JSON of this host (bench.engine.roofline): decode steps as "
                    "fractions of their bound")
    ap.add_argument("--json-out", default="bench/results/grammar.json")
    args = ap.parse_args(argv)
    from bench.engine.roofline import load_roofline
    from bench.provenance import provenance, write_json
    from engine.models import resolve_model

    prov = provenance("engine.grammar", argv)
    roof = load_roofline(args.roofline, str(resolve_model(args.model))) if args.roofline else None
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=512))
    out: dict = {"args": vars(args), "dtype": str(engine.runner.dtype).removeprefix("torch."), "roofline": roof}
    if args.n:
        out["n_choices"] = n_choices(engine, 1024, 32, args.rounds)
    else:
        t = time.perf_counter()
        engine.grammars._lltokenizer()
        out["tokenizer_build_ms"] = (time.perf_counter() - t) * 1e3
        print(f"llguidance tokenizer build (once per engine): {out['tokenizer_build_ms']:.0f} ms")
        out["compile"] = compile_times(engine)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)             # one thread: a shared host's load stalls no parallel region
        out["sampling"] = {"rows": args.rows, "reps": args.reps, "vocab": engine.grammars.vocab_size,
                           "by_constrained": micro(engine.grammars, args.rows, args.reps)}
        torch.set_num_threads(threads)
        out["threads"] = threads
        if args.decode:
            out["decode"] = decode(engine, [int(s) for s in args.streams.split(",")], args.steps, args.rounds)
    engine.close()
    write_json(args.json_out, prov, **out)
    print(f"wrote {args.json_out}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
