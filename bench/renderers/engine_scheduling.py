"""docs/BENCHMARKS.md §2: decode smoothness under chunked prefill (`bench.engine.scheduling smoothness`);
§1: what a preemption costs, recompute against swap (`bench.engine.scheduling preemption`)."""

from __future__ import annotations

from bench.renderers.common import caption, table

TARGET = 2.0            # chunked prefill: ITL p99 <= 2x its p50 while long prompts arrive


def _f(x, spec: str, unit: str) -> str:
    return "—" if x is None else format(x, spec) + unit


def render_smoothness(data: dict, name: str) -> str:
    a, result = data["args"], data["result"]
    extra = (f"; {data.get('dtype') or a.get('dtype')}, {a['streams']} streams decoding (32-token prompts) while "
             f"{a['long_prompts']} prompts of {a['long_tokens']:,} tokens arrive, one every {a['arrival_every']} steps; "
             f"ITL of the {a['streams']} streams until every long prompt has its first token. "
             f"Target: chunked p99 ≤ {TARGET:g}× its p50")
    lines = [caption(data, name, extra), "",
             "| mode | budget | ITL p50 | ITL p99 | p99 / p50 | ITL max | long-prompt TTFT (median) | ITL samples |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, r in result.items():
        ratio = r["itl_p99_ms"] / r["itl_p50_ms"]
        mark = f"**{ratio:.2f}** ({'met' if ratio <= TARGET else 'missed'})" if mode.startswith("chunked") else f"{ratio:.2f}"
        lines.append(f"| {mode} | {r['budget']:,} | {r['itl_p50_ms']:,.0f} ms | {r['itl_p99_ms']:,.0f} ms | {mark} | "
                     f"{_f(r.get('itl_max_ms'), ',.0f', ' ms')} | {_f(r.get('long_prompt_ttft_s_median'), '.2f', ' s')} | "
                     f"{_f(r.get('itl_samples'), ',', '')} |")
    return "\n".join(lines)


def render_preemption(data: dict, name: str) -> str:
    a, result = data["args"], data["result"]
    extra = (f"; {data.get('dtype') or a.get('dtype')}, {result['threads']} threads, blocks of {result['block_size']} "
             f"tokens; the median of {a['repeats']} of each: recompute = one request of the context prefilled "
             "again (chunks of 1,024) to its first token, swap = its blocks copied to the host pool and back")
    rows = [[f"{r['context_tokens']:,}", f"{r['recompute_s_median'] * 1000:,.1f} ms",
             f"{r['swap_out_and_in_s_median'] * 1000:,.1f} ms", f"{r['swap_bytes'] / 2**20:,.1f} MiB",
             f"**{r['recompute_s_median'] / r['swap_out_and_in_s_median']:,.0f}×**"] for r in result["rows"]]
    return "\n".join([caption(data, name, extra), "",
                      *table(["context tokens", "recompute", "swap out + in", "bytes moved (out + in)",
                              "recompute / swap"], rows)])


RENDERERS = {"engine.scheduling smoothness": render_smoothness, "engine.scheduling preemption": render_preemption}
