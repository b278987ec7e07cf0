"""docs/BENCHMARKS.md §6: streamgate against another server, side by side (`bench.peers`;
the run's peers.json): a synthetic run's rows by stream count, a table per compared server; a
grounded run's (`--workload grounded`) by workload and stream count, every server in one table."""

from __future__ import annotations

from bench.engine.roofline import WEIGHT_BYTES, serving_tok_s
from bench.peers.probe import IDLE_BUSY, best_flops, level_bound
from bench.peers.report import level
from bench.renderers.common import caption
from bench.renderers.engine_common import rates, roofline_note


def _tps(x) -> str:
    return "—" if x is None else f"{x:.1f}"


def _s(ms) -> str:
    return "—" if ms is None else f"{ms / 1000:.2f} s"


def _ratio(a, b, bold: bool = False) -> str:
    if a is None or not b:
        return "—"
    return f"**{a / b:.2f}×**" if bold else f"{a / b:.2f}×"


def _pair(a, b, unit: str = " ms") -> str:
    return f"{'—' if a is None else f'{a:.0f}'} / {'—' if b is None else f'{b:.0f}'}{unit}"


def _loads(data: dict) -> list[float]:
    p = data.get("provenance") or {}
    loads = [*(data.get("loadavg_range") or []), p.get("loadavg_start"), p.get("loadavg_end")]
    loads += [s.get(k) for s in data["servers"].values() for k in ("load_before", "load_after")]
    return [x for x in loads if x is not None]


def _prompt_tokens(servers: dict) -> str:
    """Each grounded workload's prompt tokens as the servers reported them ("/" where they differ)."""
    counts: dict[str, set] = {}
    for s in servers.values():
        for r in s.get("rows", []):
            counts.setdefault(r["workload"], set()).update(r.get("prompt_tokens") or ())
    return ", ".join(f"{w} {'/'.join(map(str, sorted(n))) or '?'}" for w, n in counts.items())


def bounds(data: dict) -> dict[int, float] | None:
    """Each stream count's bound in output tok/s (bench.engine.roofline's `serving_tok_s`) from the
    run's embedded roofline of the same host (bench.peers --roofline): bf16 weights, the roofline's
    prompt (the synthetic prompt with its chat template) and the run's output tokens. None without
    one, and for grounded runs (their prompts are cached after the first)."""
    a, got = data["args"], rates(data, "bfloat16")
    if got is None or a.get("workload") == "grounded":
        return None
    shapes, r = got
    prompt = prompt_in(data)
    levels = {row["concurrency"] for s in data["servers"].values() for row in s.get("rows", [])}
    return {c: serving_tok_s(shapes, r, c, prompt, a["output_tokens"], WEIGHT_BYTES["bfloat16"]) for c in levels}


def prompt_in(data: dict) -> int | None:
    """The prompt tokens the bound assumes: the roofline's workload's where it is this run's
    prompt with a chat template's few dozen tokens (same output length), else the run's own."""
    mine, work = data["args"].get("prompt_tokens"), (data.get("roofline") or {}).get("workload") or {}
    theirs = work.get("prompt_tokens")
    if mine and theirs and mine <= theirs <= mine + 64 and work.get("output_tokens") == data["args"].get("output_tokens"):
        return theirs
    return mine


def probed_bounds(data: dict) -> dict[str, dict[int, float]] | None:
    """Each server's bound at each of its levels from the roofline probed beside that level
    (bench/peers/probe.py), or None where the run has no probes."""
    info = data.get("probe")
    if not info:
        return None
    got = {name: {r["concurrency"]: b for r in s.get("rows", []) if (b := level_bound(info, r)) is not None}
           for name, s in data["servers"].items()}
    return got if any(got.values()) else None


def probe_note(data: dict) -> str:
    """The caption's words on the probed bounds: what they are and the range the probes spanned."""
    probes = [p for s in data["servers"].values() for r in s.get("rows", []) if (q := r.get("roofline_probe"))
              for p in (q["before"], q["after"])]
    if not probes:
        return ""
    info = data["probe"]
    bw = [p["read_bandwidth"] / 1e9 for p in probes]
    fl = [best_flops(p) / 1e9 for p in probes]
    fp32 = any("fp32_flops" in p for p in probes)
    busy = sorted({(p["at"], p["busy"]): p["busy"] for p in probes if (p.get("busy") or 0) >= IDLE_BUSY}.values())
    return (f" Each level's own bound (bench/peers/probe.py): the roofline probed right before and after that level, "
            f"once the machine was idle ({info['threads']} threads, best of {info['reps']}), the higher of the two; "
            f"bf16 weights, {info['workload']['prompt_tokens']} tokens in, {info['workload']['output_tokens']} out; "
            f"the probes read {min(bw):.1f}–{max(bw):.1f} GB/s and computed {min(fl):.0f}–{max(fl):.0f} "
            + ("GFLOP/s (the faster of bf16 and fp32)" if fp32 else "bf16 GFLOP/s")
            + (f"; {len(busy)} began with the CPUs still up to {100 * busy[-1]:.0f} % busy" if busy else ""))


def _share(tps, bound) -> str:
    return "—" if tps is None or not bound else f"{100 * tps / bound:.0f} %"


def table(peer: str, peer_rows: list[dict], name: str, rows: list[dict],
          bound: dict[int, float] | None = None,
          probed: tuple[dict[int, float], dict[int, float]] | None = None) -> list[str]:
    """One line per level either side measured (stream count; workload and stream count for
    grounded rows): tok/s and its ratio, TTFT p99 and its ratio (lower is better), ITL p50, with
    `bound` (tok/s by stream count) each side's share of it, and with `probed` (each side's bound
    at each level from its own probes) both bounds and each side's share of its own."""
    grounded = any("workload" in r for r in [*peer_rows, *rows])
    base = {level(r): r for r in peer_rows}
    mine = {level(r): r for r in rows}
    lines = [f"| {'workload | ' if grounded else ''}streams | {peer} tok/s | {name} tok/s | × {peer} "
             f"| TTFT p99, {peer} / {name} | × {peer} | ITL p50, {peer} / {name} |"
             + (f" bf16 bound tok/s | % of it, {peer} / {name} |" if bound else "")
             + (f" level's own bound, {peer} / {name} | % of own, {peer} / {name} |" if probed else ""),
             f"|{'---|' if grounded else ''}---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if bound else "")
             + ("---:|---:|" if probed else "")]
    for k in sorted(base.keys() | mine.keys()):
        b, m = base.get(k, {}), mine.get(k, {})
        lead = " | ".join(map(str, k)) if grounded else str(k)
        line = (f"| {lead} | {_tps(b.get('output_tps'))} | {_tps(m.get('output_tps'))} | "
                f"{_ratio(m.get('output_tps'), b.get('output_tps'), bold=True)} | "
                f"{_s(b.get('ttft_p99_ms'))} / {_s(m.get('ttft_p99_ms'))} | "
                f"{_ratio(m.get('ttft_p99_ms'), b.get('ttft_p99_ms'))} | "
                f"{_pair(b.get('itl_p50_ms'), m.get('itl_p50_ms'))} |")
        if bound:
            c = bound.get(k)
            line += (f" {_tps(c)} | {_share(b.get('output_tps'), c)} / **{_share(m.get('output_tps'), c)}** |")
        if probed:
            cb, cm = probed[0].get(k), probed[1].get(k)
            line += (f" {'—' if cb is None else f'{cb:.0f}'} / {'—' if cm is None else f'{cm:.0f}'} | "
                     f"{_share(b.get('output_tps'), cb)} / **{_share(m.get('output_tps'), cm)}** |")
        lines.append(line)
    return lines


def grounded_table(peer: str, servers: dict, others: list[str]) -> list[str]:
    """A grounded run in one table: a line per workload and level, each server's tok/s with
    its ratio to the peer's, then every server's TTFT p99 and ITL p50 side by side."""
    by = {n: {level(r): r for r in servers.get(n, {}).get("rows", [])} for n in [peer, *others]}
    names = " / ".join([peer, *others])
    lines = [f"| workload | streams | {peer} tok/s | " + " | ".join(f"{o} tok/s (× {peer})" for o in others)
             + f" | TTFT p99, {names} | ITL p50, {names} |",
             "|---|---:|---:|" + "---:|" * len(others) + "---:|---:|"]
    for k in sorted(set().union(*by.values())):
        rows = [by[n].get(k, {}) for n in [peer, *others]]
        base = rows[0].get("output_tps")
        mine = " | ".join(f"{_tps(r.get('output_tps'))} ({_ratio(r.get('output_tps'), base, bold=True)})"
                          for r in rows[1:])
        ttft = " / ".join(_s(r.get("ttft_p99_ms")).removesuffix(" s") for r in rows) + " s"
        itl = " / ".join("—" if r.get("itl_p50_ms") is None else f"{r['itl_p50_ms']:.0f}" for r in rows) + " ms"
        lines.append(f"| {k[0]} | {k[1]} | {_tps(base)} | {mine} | {ttft} | {itl} |")
    return lines


def render_peers(data: dict, name: str) -> str:
    a, servers = data["args"], data["servers"]
    peer = a["peer"]
    if a.get("workload") == "grounded":
        prompts = (f"bench.engine.speculative's input-grounded prompts (tokens as the servers counted them: "
                   f"{_prompt_tokens(servers)}; each repeated, so after its first request a server's prefix "
                   "cache holds it), greedy")
    else:
        prompts = f"{a.get('prompt_tokens')}-token prompts"
    extra = (f"; {a.get('client', '?')} client, {prompts}, {a.get('output_tokens')} output "
             f"tokens, servers in the order {', '.join(servers)}")
    if data.get("env"):
        extra += "; environment " + " ".join(f"`{k}={v}`" for k, v in sorted(data["env"].items()))
    failed = sum(r.get("failed") or 0 for s in servers.values() for r in s.get("rows", []))
    if failed:
        extra += f"; **{failed} requests failed**"
    for note in data.get("skipped", []):
        extra += f"; {note}"
    bound = bounds(data)
    if bound:
        extra += (f". The bound: output tok/s with bf16 weights at each level ({prompt_in(data)} tokens in, "
                  f"{a.get('output_tokens')} out, in waves), bench.engine.roofline's model.{roofline_note(data)}")
    elif data.get("roofline"):
        extra += "." + roofline_note(data)
    probed = probed_bounds(data)
    if probed:
        extra += "." + probe_note(data)
    lines = [caption({**data, "loadavg_range": _loads(data)}, name, extra)]
    others = [n for n, s in servers.items() if n != peer and s.get("rows")]
    if a.get("workload") == "grounded":
        lines += [""] + grounded_table(peer, servers, others)
        others = []
    for other in others:
        lines.append("")
        if len(others) > 1:
            lines += [f"**{other}** against **{peer}**:", ""]
        both = (probed.get(peer, {}), probed.get(other, {})) if probed else None
        lines += table(peer, servers.get(peer, {}).get("rows", []), other, servers[other]["rows"], bound, both)
    errors = [f"{n}: {e.splitlines()[0]}" for n, s in servers.items() for e in s.get("errors", [])]
    if errors:
        lines += ["", "Errors: " + "; ".join(errors)]
    return "\n".join(lines)


RENDERERS = {"peers": render_peers}
