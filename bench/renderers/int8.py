"""docs/BENCHMARKS.md §10: int8 weight-only linears against bf16 (`bench.engine.int8`)."""

from __future__ import annotations

from bench.renderers.common import caption

TARGET = 1.6            # issue 29: single-stream decode >= 1.6x bf16


def render_int8(data: dict, name: str) -> str:
    a, dec, pre = data["args"], data["decode"], data["prefill"]
    med, pmed, nb, ppl, agree = dec["median_s"], pre["median_s"], data["weight_bytes"], data["perplexity"], data["agreement"]
    speedup = med["bfloat16"] / med["int8"]
    extra = (f"; {data.get('kernels') or 'no C++'} kernels, {a['threads']} threads, {a['steps']} alternating "
             f"one-row decode steps each at {a['ctx']} tokens of context")
    verdict = "met" if speedup >= TARGET else "not met"
    mb = 1e6

    def pct(x: float) -> str:
        return f"{100 * x:.1f} %"

    lines = [caption(data, name, extra), "",
             "| | bf16 | int8 | int8 / bf16 |",
             "|---|---:|---:|---:|",
             f"| one-row decode step, median | {med['bfloat16'] * 1e3:.1f} ms | {med['int8'] * 1e3:.1f} ms | "
             f"**{speedup:.2f}× faster** (per-round pairs: {dec['paired_speedup']:.2f}×; target {TARGET}×: {verdict}) |",
             f"| {a['window']}-token prefill step, median of {a['prefill_reps']} | {pmed['bfloat16'] * 1e3:.0f} ms | "
             f"{pmed['int8'] * 1e3:.0f} ms | {pmed['int8'] / pmed['bfloat16']:.2f}× the time |",
             f"| linear weights held (codes + scales + biases) | {nb['bf16'] / mb:.1f} MB | {nb['int8'] / mb:.1f} MB "
             f"+ {nb['scratch'] / mb:.1f} MB scratch | {(nb['int8'] + nb['scratch']) / nb['bf16']:.2f}× the bytes |",
             f"| perplexity, {a['ppl_tokens']:,} held-out tokens in windows of {a['window']} "
             f"(fp32: {ppl['float32']:.2f}) | {ppl['bfloat16']:.2f} | {ppl['int8']:.2f} | "
             f"{100 * (ppl['int8'] / ppl['bfloat16'] - 1):+.1f} % |",
             f"| greedy agreement with bf16, {data['agree_prompts']} chat prompts × {a['agree_tokens']} tokens: "
             f"tokens before the first difference (equal positions) | fp32: {pct(agree['float32']['prefix'])} "
             f"({pct(agree['float32']['positions'])}) | {pct(agree['int8']['prefix'])} "
             f"({pct(agree['int8']['positions'])}) | |"]
    return "\n".join(lines)


RENDERERS = {"engine.int8": render_int8}
