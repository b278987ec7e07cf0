"""docs/BENCHMARKS.md §10: the int8 KV cache against the model dtype's (`bench.engine.kv_int8`)."""

from __future__ import annotations

from bench.renderers.common import caption


def render_kv_int8(data: dict, name: str) -> str:
    a, dec, ppl, agree, nb = data["args"], data["decode"], data["perplexity"], data["agreement"], data["block_bytes"]
    dt = a["dtype"]
    extra = (f"; {data.get('kernels') or 'no C++'} kernels, {a['dtype']} model, {a['steps']} alternating decode "
             f"steps of each engine per row count, every sequence at {a['ctx']} tokens of context")

    def pct(x: float) -> str:
        return f"{100 * x:.1f} %"

    lines = [caption(data, name, extra), "",
             f"| | {dt} KV cache | int8 KV cache | {dt} / int8 |",
             "|---|---:|---:|---:|"]
    for rows, run in dec.items():
        med = run["median_s"]
        lines.append(f"| {rows}-row decode step, median | {med['dtype'] * 1e3:.1f} ms | {med['int8'] * 1e3:.1f} ms | "
                     f"**{med['dtype'] / med['int8']:.2f}× faster** |")
    lines += [f"| a 16-token KV block, all layers | {nb['dtype'] / 1e3:.1f} kB | {nb['int8'] / 1e3:.1f} kB | "
              f"{nb['dtype'] / nb['int8']:.2f}× the tokens a GiB |",
              f"| perplexity, {a['ppl_tokens']:,} held-out tokens in windows of {a['window']} "
              f"(fp32: {ppl['float32']:.2f}) | {ppl['dtype']:.2f} | {ppl['int8']:.2f} | "
              f"{100 * (ppl['int8'] / ppl['dtype'] - 1):+.1f} % |",
              f"| greedy agreement with the {dt} KV cache, {data['agree_prompts']} chat prompts × "
              f"{a['agree_tokens']} tokens: tokens before the first difference (equal positions) | "
              f"fp32 model: {pct(agree['float32']['prefix'])} ({pct(agree['float32']['positions'])}) | "
              f"{pct(agree['int8']['prefix'])} ({pct(agree['int8']['positions'])}) | |"]
    return "\n".join(lines)


RENDERERS = {"engine.kv_int8": render_kv_int8}
