"""docs/BENCHMARKS.md §7: tensor parallelism on a CPU (`bench.engine.tp`)."""

from __future__ import annotations

from bench.renderers.common import caption, table


def render_tp(data: dict, name: str) -> str:
    a, rows = data["args"], data["rows"]
    model = (f"a local model ({a['model']})" if a.get("model") else
             f"a random Llama, hidden {a['hidden']:,}, FFN {a['intermediate']:,}, {a['heads']} heads / "
             f"{a['kv_heads']} KV heads, {a['layers']} layers, {a['vocab']:,}-token vocabulary")
    extra = (f"; {model}, {a.get('dtype')}, {a['device']}; {a['batch']} sequences of {a['prompt']}-token prompts: "
             f"one prefill step, then the mean of {a['new'] - 1} {a['batch']}-row decode steps")
    first = rows[0]
    head = ["TP", "threads (all ranks)", "prefill step", "decode step", "decode vs the first row", "broadcast share",
            "collectives share (profiled)", "idle round trip"]
    body = [[r["tp"], r["threads"], f"{r['prefill_step_ms']:,.0f} ms", f"{r['decode_step_ms']:,.0f} ms",
             f"{r['decode_step_ms'] / first['decode_step_ms']:.2f}×", f"{r['broadcast_share']:.1%}",
             f"{r['comm_share_profiled']:.1%}", "—" if r["tp"] == 1 else f"{r['ping_p50_ms']:.2f} ms"] for r in rows]
    lines = [caption(data, name, extra), "", *table(head, body, "r" * len(head))]
    return "\n".join(lines).replace("%", " %").replace("  %", " %")


RENDERERS = {"engine.tp": render_tp}
