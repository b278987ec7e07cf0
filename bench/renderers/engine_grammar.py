"""docs/BENCHMARKS.md §9: what constrained decoding costs (`bench.engine.grammar`)."""

from __future__ import annotations

from bench.renderers.common import caption
from bench.renderers.engine_common import decode_bound_ms, pct, rates, roofline_note


def _ms(x: float) -> str:
    return f"{x * 1e3:.0f} µs" if x < 0.1 else f"{x:.2f} ms"


def render_grammar(data: dict, name: str) -> str:
    a = data["args"]
    extra = f"; SmolLM2, {data.get('dtype')}"
    lines = []
    if "compile" in data:
        c, s = data["compile"], data["sampling"]
        by = s["by_constrained"]
        rows_n = str(s["rows"])
        lines += ["", "| what | time |", "|---|---:|",
                  f"| llguidance tokenizer build (once per engine, on the first grammar) | {data['tokenizer_build_ms']:,.0f} ms |"]
        for key, label in (("small", "small"), ("large", "large")):
            g = c[key]
            lines += [f"| admission check (`Grammar.check`), {label} schema ({g['bytes']:,} B), first, uncached | "
                      f"{_ms(g['check_ms'])} |",
                      f"| token-level compile, {label} schema, 3 runs | "
                      f"{' / '.join(_ms(x) for x in g['compile_ms'])} |"]
        for k, label in (("0", "no row"), ("1", "1 row"), (rows_n, f"all {rows_n} rows")):
            if k in by:
                lines.append(f"| {s['rows']} sampling rows over {s['vocab']:,} tokens, {label} constrained: mask fill + "
                             f"unpack / with sampling (one thread, median of {s['reps']}) | {_ms(by[k]['mask_ms'])} / "
                             f"{_ms(by[k]['with_sampling_ms'])} |")
    if data.get("decode"):
        sr = rates(data, data.get("dtype") or "bfloat16")
        extra += (f". Decode: phases of {a['steps']} pure decode steps with 0, 1 and all streams constrained, "
                  f"alternating, {a['rounds']} rounds; the constrained rows sample under a schema that cannot end "
                  f"within the phase; median step, each round's in brackets."
                  + (" The bound is the step's weight and KV reads at the prompt's 128 tokens of context or its "
                     "FLOPs at the peak, whichever is longer." if sr else "") + roofline_note(data))
        lines += ["", "| streams | constrained | step | forward | vs none | % of the bound |",
                  "|---:|---:|---:|---:|---:|---:|"]
        base = {r["streams"]: r["step_ms"] for r in data["decode"] if r["constrained"] == 0}
        for r in data["decode"]:
            bound = decode_bound_ms(*sr, data["dtype"], r["streams"], r.get("prompt_tokens", 128)) if sr else None
            vs = "—" if r["constrained"] == 0 else f"{100 * (r['step_ms'] / base[r['streams']] - 1):+.1f} %"
            lines.append(f"| {r['streams']} | {r['constrained']} | {r['step_ms']:.2f} ms "
                         f"[{', '.join(f'{x:.2f}' for x in r['rounds_ms'])}] | {r['forward_ms']:.2f} ms | "
                         f"{vs.replace('-', '−')} | {pct(bound, r['step_ms'])} |")
    if data.get("n_choices"):
        lines += ["", "| round | what | wall | prompt tokens computed |", "|---:|---|---:|---:|"]
        lines += [f"| {r['round']} | {r['kind']} | {r['wall_s']:.2f} s | {r['prompt_tokens_computed']:,} |"
                  for r in data["n_choices"]]
    return "\n".join([caption(data, name, extra)] + lines)


RENDERERS = {"engine.grammar": render_grammar}
