"""docs/BENCHMARKS.md §10, the roofline table (`bench.engine.roofline`)."""

from __future__ import annotations

from bench.renderers.common import caption


def render_roofline(data: dict, name: str) -> str:
    mm, b, w = data["matmul_flops"], data["bounds"], data["workload"]
    isa = (data.get("onednn") or {}).get("verbose_isa")
    extra = (f"; {data['dtype']} weights, {data['threads']} thread{'' if data['threads'] == 1 else 's'}, best of {data['reps']}"
             + (f"; oneDNN dispatches to \"{isa}\"" if isa else ""))
    rows = list(mm["bfloat16"])
    streams = list(b["serving_tok_s"])
    steps = list(b["decode_step_ms"])
    lines = [caption(data, name, extra), "", "| measured | value |", "|---|---:|",
             f"| bf16 matmul at {' / '.join(rows)} rows (best of F.linear and oneDNN prepacked) | "
             f"{' / '.join(f'{v / 1e9:,.0f}' for v in mm['bfloat16'].values())} GFLOP/s |",
             f"| fp32 matmul at {' / '.join(mm['float32'])} rows | "
             f"{' / '.join(f'{v / 1e9:,.0f}' for v in mm['float32'].values())} GFLOP/s |",
             f"| memory read bandwidth | {data['read_bandwidth'] / 1e9:.1f} GB/s |",
             f"| bound: a decode step of {' / '.join(steps)} rows | "
             f"{' / '.join(f'{v:.1f}' for v in b['decode_step_ms'].values())} ms |",
             f"| bound: a {b['prefill_chunk_tokens']}-token prefill chunk | {b['prefill_chunk_ms']:,.0f} ms |",
             f"| bound: the GuideLLM-like workload ({w['prompt_tokens']} in, {w['output_tokens']} out) at "
             f"{' / '.join(streams)} streams | {' / '.join(f'{v:,.0f}' for v in b['serving_tok_s'].values())} output tok/s |"]
    for n, tok in (data.get("measured_tok_s") or {}).items():
        lines.append(f"| served at {n} streams (`--measured`, this host) | {tok:,.1f} tok/s = "
                     f"{100 * data['fraction_of_bound'][n]:.0f} % of the bound |")
    return "\n".join(lines)


RENDERERS = {"engine.roofline": render_roofline}
