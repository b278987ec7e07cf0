"""docs/BENCHMARKS.md §11: KV blocks a long conversation holds (`bench.engine.families kv`)."""

from __future__ import annotations

from bench.renderers.common import _n, caption

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


RENDERERS = {"engine.families kv": render_families_kv}
