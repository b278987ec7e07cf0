"""What the engine wing's renderers share: a run's roofline (embedded by `--roofline`, see
bench.engine.roofline.load_roofline) when, and only when, it was measured on the run's own host.

A fraction of a bound is only meaningful against the host that ran: a roofline without a host,
or from another host or CPU, yields no fraction (the renderer prints "—" and says why)."""

from __future__ import annotations

from bench.engine.roofline import Rates, Shapes, decode_step_s, embedded_rates, prefill_s
from bench.renderers.common import _utc


def run_threads(data: dict) -> int | None:
    """The torch threads the run computed on, where its JSON says."""
    return (data.get("env") or {}).get("threads") or data.get("threads") or (data.get("args") or {}).get("threads")


def same_host_roofline(data: dict) -> dict | None:
    """The run's embedded roofline if it names the run's host and CPU and was measured on as many
    threads as the run used (a two-core peak is no bound for one thread's run, nor the reverse
    on a loaded host); else None."""
    roof, p = data.get("roofline"), data.get("provenance") or {}
    if not roof:
        return None
    q = roof.get("provenance") or {}
    if not p.get("host") or (p.get("host"), p.get("cpu")) != (q.get("host"), q.get("cpu")):
        return None
    if roof.get("threads") and run_threads(data) and roof["threads"] != run_threads(data):
        return None
    return roof


def roofline_note(data: dict) -> str:
    """The caption's words on the bound: whose roofline, its peak and bandwidth, or why none."""
    roof = same_host_roofline(data)
    if roof is None:
        if not data.get("roofline"):
            return " No fraction of the roofline: the run's JSON carries none of its host"
        return (" No fraction of the roofline: its roofline is another host's or was measured on "
                f"{data['roofline'].get('threads')} threads, the run on {run_threads(data)}")
    q = roof["provenance"]
    flops = {k: max(v.values()) / 1e9 for k, v in roof["matmul_flops"].items()}
    return (f" Bound from the roofline of the same host and threads (`{q.get('command', '?')}`, commit `{q.get('commit', '?')}`, "
            f"{(q.get('started') or '?').split('T')[0]} {_utc(q.get('started'))} UTC): peak bf16 "
            f"{flops.get('bfloat16', 0):.0f} / fp32 {flops.get('float32', 0):.0f} GFLOP/s, read "
            f"{roof['read_bandwidth'] / 1e9:.1f} GB/s; a busy host's peaks are low, so the fractions flatter")


def rates(data: dict, dtype: str) -> tuple[Shapes, Rates] | None:
    roof = same_host_roofline(data)
    return embedded_rates(roof, dtype) if roof else None


def offline_bound_s(shapes: Shapes, r: Rates, dtype: str, prompt_tokens: int, output_tokens: int,
                    requests: int, steps: int) -> float:
    """A lower bound on an offline run's time: the prompts' prefill FLOPs plus every output token's
    linear FLOPs at the peak, or every step reading all weights once, whichever is longer
    (KV reads and decode attention left out, so it stays a lower bound)."""
    weight_bytes = {"float32": 4, "bfloat16": 2}.get(dtype, 2)
    compute = prefill_s(shapes, r, prompt_tokens, requests) + output_tokens * 2.0 * shapes.linear_params / r.flops
    read = steps * shapes.linear_params * weight_bytes / r.bandwidth
    return max(compute, read)


def decode_bound_ms(shapes: Shapes, r: Rates, dtype: str, rows: int, context: int) -> float:
    weight_bytes = {"float32": 4, "bfloat16": 2}.get(dtype, 2)
    kv_bytes = 4 if dtype == "float32" else 2
    return 1e3 * decode_step_s(shapes, r, rows, weight_bytes, context, kv_bytes)


def pct(bound: float | None, measured: float | None) -> str:
    """BOUND / MEASURED (both times) as a percentage; '—' without a bound."""
    return "—" if not bound or not measured else f"{100 * bound / measured:.0f} %"
