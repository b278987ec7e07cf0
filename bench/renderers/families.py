"""docs/BENCHMARKS.md §11: KV blocks a long conversation holds (`bench.engine.families kv`) and the
decode step per family with the MoE blocks' share (`bench.engine.families speed`)."""

from __future__ import annotations

from bench.renderers.common import _n, _span, caption, table

KV_LAYOUTS = {"all-sliding-512 (32 layers)": "32 layers, all sliding over 512",
              "gemma3-1b (5:1, window 512)": "Gemma 3 1B (26 layers, 5 sliding over 512 : 1 full)",
              "gpt-oss-20b (1:1, window 128)": "gpt-oss-20b (24 layers, 1 sliding over 128 : 1 full)"}


def render_families_kv(data: dict, name: str) -> str:
    a, result = data["args"], data["result"]
    lines = [caption(data, name, f"; {a['tokens']:,} tokens, {a['prompt']:,}-token prompt, blocks of {a['block_size']}"),
             "",
             "| layout | freeing | groups x rows | blocks at admission | blocks at the end | layer-blocks at admission "
             "| layer-blocks at the end |",
             "|---|---|---|---:|---:|---:|---:|"]
    layouts = dict.fromkeys(key.rsplit(" / ", 1)[0] for key in result)
    for layout in layouts:
        free, keep = result.get(f"{layout} / free"), result.get(f"{layout} / keep")
        for i, (label, r) in enumerate((("yes", free), ("no", keep))):
            if r is None:
                continue
            end = _n(r["layer_blocks_end"])
            if label == "yes" and keep:
                end = f"**{end}** ({keep['layer_blocks_end'] / r['layer_blocks_end']:.1f}x less)"
            lines.append(f"| {KV_LAYOUTS.get(layout, layout) if i == 0 or free is None else ''} | {label} | "
                         f"{r['groups']} x {r['rows']} | {_n(r['admission'])} | {_n(r['end'])} | "
                         f"{_n(r['layer_blocks_admission'])} | {end} |")
    return "\n".join(lines)


FAMILY_NAMES = {"smollm2-135m": "SmolLM2-135M", "qwen3_moe": "Qwen3-MoE", "gpt_oss": "gpt-oss", "mixtral": "Mixtral"}


def _params(n: int) -> str:
    """74,112 -> '74 K'; 106,168,320 -> '106 M'."""
    return f"{n / 1e6:,.0f} M" if n >= 1e6 else f"{n / 1e3:,.0f} K"


def _ms(r: dict | None) -> str:
    return "—" if r is None else f"{r['step_ms']:.2f} ({r['tokens_per_s']:,.0f})"


def render_families_speed(data: dict, name: str) -> str:
    a, env, result = data["args"], data.get("env") or {}, data["result"]
    steps = [row["generic"]["steps"] for row in result.values()] + [row["fused"]["steps"] for row in result.values()
                                                                     if row["fused"]]
    dtypes = sorted({row["generic"].get("dtype", "?") for row in result.values()})
    attention = sorted({row["generic"].get("attention", "?") for row in result.values()})
    threads = env.get("threads", a.get("threads"))
    extra = (f"; {a['seqs']} sequences decoding ({env.get('prompt_tokens', '?')}-token prompts), median of "
             f"{_span(steps)} decode-only steps, {threads} thread{'s' if threads != 1 else ''}, "
             f"{'/'.join(dtypes)}, attention: {'/'.join(attention)}"
             + (f" ({env['kernels']} kernels)" if env.get("kernels") else "")
             + "; \"fused\": the fused Llama-shaped forward, \"generic\": transformers' forward with the engine's "
             "attention (`fused_layers=False`)")
    base = (result.get("llama") or {}).get("generic")
    rows = []
    for fam, row in result.items():
        g = row["generic"]
        params = _params(g["non_embedding_params"])
        if row.get("experts"):
            params += f" ({row['experts']} experts, top {row['top_k']})"
        vs = "—" if not base else f"{g['step_ms'] / base['step_ms']:.2f}x"
        if base and fam == "smollm2-135m":
            vs += f" ({g['non_embedding_params'] / base['non_embedding_params']:,.0f}x the parameters)"
        rows.append([FAMILY_NAMES.get(fam, fam), params, _ms(row["fused"]), _ms(g), vs])
    lines = [caption(data, name, extra), "",
             *table(["family", "non-embedding params", "fused ms (tok/s)", "generic ms (tok/s)", "generic vs Llama"],
                    rows, "llrrr")]
    moe = [(fam, row) for fam, row in result.items() if row.get("moe")]
    if moe:
        parts = [f"{FAMILY_NAMES.get(fam, fam)}'s {row['moe']['moe_mlp_ms']:.2f} ms of {row['generic']['step_ms']:.2f}"
                 for fam, row in moe]
        saves = [row["moe"]["saving_ms_per_step"] / row["generic"]["step_ms"] for _, row in moe]
        dense = f", against {base['mlp_ms']:.2f} ms for Llama's dense MLPs" if base and base.get("mlp_ms") else ""
        lines += ["", f"MoE blocks (forward hooks, generic forward, same run): {', '.join(parts)} ms a step{dense}; "
                  "an expert-grouped GEMM at the dense MLP's time per FLOP would save "
                  + ", ".join(f"{row['moe']['saving_ms_per_step']:.2f}" for _, row in moe)
                  + f" ms a step (at most {100 * max(saves):.0f} % of the step)."]
    return "\n".join(lines)


RENDERERS = {"engine.families kv": render_families_kv, "engine.families speed": render_families_speed}
