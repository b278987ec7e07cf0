"""docs/BENCHMARKS.md §12: speculative decoding (`bench.engine.speculative`)."""

from __future__ import annotations

from bench.renderers.common import _n, _span, caption, table

SPEC_WORKLOADS = {"chat": "open chat"}


def render_speculative(data: dict, name: str) -> str:
    rows = data["rows"]
    bound = rows[0]["bound_tok_s"] if rows else None
    extra = f"; {data.get('dtype', '?')}, k = {data['args']['k']}"
    if data.get("bandwidth"):
        extra += f", read bandwidth {data['bandwidth'] / 1e9:.1f} GB/s, one-row decode bound {bound:.1f} tok/s"
    loads = [r["load"] for r in rows if r.get("load") is not None]
    if loads and not data.get("loadavg_range"):
        data = {**data, "loadavg_range": loads + [v for v in (data.get("provenance", {}).get(k) for k in
                                                               ("loadavg_start", "loadavg_end")) if v is not None]}

    def rate(pair: list[float]) -> str:
        share = f", {round(100 * pair[1] / bound)} %" if bound else ""
        return f"{pair[0]:.1f} ({pair[1]:.1f}{share})"

    head = ["workload", "prompt tokens", "output tokens", "off: tok/s (decode, % of bound)",
            "on: tok/s (decode, % of bound)", "decode on/off", "drafts accepted", "same tokens"]
    body = [[SPEC_WORKLOADS.get(r["workload"], r["workload"]), _span(r.get("prompt_tokens")), _n(r.get("output_tokens")),
             rate(r["off_tok_s"]), rate(r["on_tok_s"]), f"{r['speedup_decode']:.2f}×", f"{r['accepted']} / {r['drafted']}",
             "yes" if r["same_tokens"] else "no"] for r in rows]
    return "\n".join([caption(data, name, extra), "", *table(head, body, "lrrrrrrl")])


RENDERERS = {"engine.speculative": render_speculative}
