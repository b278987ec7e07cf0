"""docs/BENCHMARKS.md §8: kernels alone, paged attention (`bench.engine.attention`) and the linear
layers (`bench.engine.gemm`)."""

from __future__ import annotations

from bench.renderers.common import caption, table


def _threads(n: int) -> str:
    return f"{n} thread{'' if n == 1 else 's'}"


def _batch(r: dict) -> str:
    ctx = f"{r['min_ctx']:,}" if r["min_ctx"] == r["max_ctx"] else f"{r['min_ctx']:,}–{r['max_ctx']:,}"
    if r["chunk"] == 1:
        return f"{r['seqs']} decode rows over {ctx} tokens"
    over = "" if r["chunk"] >= r["min_ctx"] else f" over {ctx}"
    return f"{r['seqs']} × {r['chunk']:,}-token chunk{'s' if r['seqs'] > 1 else ''}{over or (' (first chunks)' if r['seqs'] > 1 else ' (first chunk)')}"


def render_attention(data: dict, name: str) -> str:
    amx = data.get("amx", False)
    extra = (f"; SmolLM2's shapes (9 query / 3 KV heads, head_dim 64, 30 layers), {data['dtype']}, "
             f"{_threads(data['threads'])}, median of {data['reps']} steps, the backends alternating"
             + ("; the kernel's query tiles on AMX tiles, and with them off (VDPBF16PS, what a CPU without AMX runs)"
                if amx else ""))
    # Decode rows also ran the other way of bringing the next span into cache (csrc/attention_decode.h).
    walk = next((r for r in data["rows"] if "kernel_other_walk_ms" in r), None)
    other = walk and ("prefetched" if walk["span_loads"] else "loaded")
    # ... and whole, in one part (csrc/attention_parts.h), where the build cuts them.
    parts = any("kernel_one_part_ms" in r for r in data["rows"])
    head = "| batch (`--case`) | gather + SDPA | kernel | kernel speed-up |"
    lines = [caption(data, name, extra), "",
             head + (" kernel, no AMX | AMX speed-up |" if amx else "")
             + (f" kernel, next span {other} | {'loads' if walk['span_loads'] else 'prefetch'} speed-up |" if walk else "")
             + (" kernel, rows in one part | parts speed-up |" if parts else ""),
             "|---|---:|---:|---:|" + ("---:|---:|" if amx else "") + ("---:|---:|" if walk else "")
             + ("---:|---:|" if parts else "")]
    for r in data["rows"]:
        case = f"{r['seqs']}x{r['min_ctx']}-{r['max_ctx']}/{r['chunk']}"
        row = (f"| {_batch(r)} (`{case}`) | {r['torch_ms']:,.1f} ms | {r['kernel_ms']:,.1f} ms | "
               f"{r['torch_ms'] / r['kernel_ms']:.2f}× |")
        if amx and r["chunk"] == 1:                             # decode rows take no query tiles: the same code
            row += f" {r['kernel_no_amx_ms']:,.1f} ms | — |"
        elif amx:
            row += f" {r['kernel_no_amx_ms']:,.1f} ms | {r['kernel_no_amx_ms'] / r['kernel_ms']:.2f}× |"
        if walk:
            row += (f" {r['kernel_other_walk_ms']:,.1f} ms | {r['kernel_other_walk_ms'] / r['kernel_ms']:.2f}× |"
                    if "kernel_other_walk_ms" in r else " — | — |")
        if parts:
            row += (f" {r['kernel_one_part_ms']:,.1f} ms | {r['kernel_one_part_ms'] / r['kernel_ms']:.2f}× |"
                    if "kernel_one_part_ms" in r else " — | — |")
        lines.append(row)
    return "\n".join(lines)


def render_crossover(data: dict, name: str) -> str:
    """`bench.engine.gemm --crossover`: per row count, each layer's oneDNN time over the bf16
    block kernel's (above 1: the kernel is faster) and the kernel's GFLOP/s."""
    extra = (f"; the {data['variant']} build, median of {data['args']['reps']} alternating calls, "
             f"{_threads(data['threads'])}; a cell is oneDNN's time / the block kernel's (above 1: the kernel is "
             "faster) and the kernel's GFLOP/s")
    layers = list(dict.fromkeys(r["layer"] for r in data["rows"]))
    cells = {(r["layer"], r["rows"]): r for r in data["rows"]}
    body = []
    for m in sorted({r["rows"] for r in data["rows"]}):
        row: list = [m]
        for layer in layers:
            r = cells.get((layer, m))
            gf = r and 2 * m * r["in"] * r["out"] / (r["block_bf16_ms"] * 1e-3) / 1e9
            row.append("—" if r is None else f"{r['onednn_bf16_ms'] / r['block_bf16_ms']:.2f}× ({gf:,.0f})")
        body.append(row)
    first = {r["layer"]: r for r in reversed(data["rows"])}
    head = ["rows", *(f"{layer} {first[layer]['in']:,}→{first[layer]['out']:,}" for layer in layers)]
    return "\n".join([caption(data, name, extra), "", *table(head, body)])


def render_gemm(data: dict, name: str) -> str:
    if data["args"].get("crossover"):
        return render_crossover(data, name)
    extra = (f"; median of {data['args']['reps']} calls, {_threads(data['threads'])}; native bf16 "
             f"{'yes' if data['native_bf16'] else 'no'}, C++ kernel {'built' if data['kernel'] else 'not built'}")
    lines = [caption(data, name, extra), "",
             "| layer | rows | C++ kernel fp32, ms | MKL fp32, ms | torch bf16, ms | oneDNN bf16 (prepacked), ms | best bf16 / best fp32 "
             "| best bf16 GFLOP/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    last = None
    for r in data["rows"]:
        fp32 = min(v for v in (r["kernel_fp32_ms"], r["mkl_fp32_ms"]) if v is not None)
        bf16 = min(r["torch_bf16_ms"], r["onednn_bf16_ms"])
        label = "" if r["layer"] == last else f"{r['layer']} {r['in']:,}→{r['out']:,}"
        last = r["layer"]
        kernel = "—" if r["kernel_fp32_ms"] is None else f"{r['kernel_fp32_ms']:.3f}"
        gflops = 2 * r["rows"] * r["in"] * r["out"] / (bf16 * 1e-3) / 1e9
        lines.append(f"| {label} | {r['rows']} | {kernel} | {r['mkl_fp32_ms']:.3f} | {r['torch_bf16_ms']:.3f} | "
                     f"{r['onednn_bf16_ms']:.3f} | {bf16 / fp32:.2f}× | {gflops:,.0f} |")
    return "\n".join(lines)


RENDERERS = {"engine.attention": render_attention, "engine.gemm": render_gemm}
