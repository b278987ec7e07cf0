"""docs/BENCHMARKS.md §5: the latency Redis adds to admission + settlement
(`bench.serving.quota_backends`)."""

from __future__ import annotations

from bench.renderers.common import caption


def load_label(key: str) -> str:
    """'back_to_back' -> 'back to back', '50_per_s' -> '50 req/s'."""
    return "back to back" if key == "back_to_back" else key.replace("_per_s", " req/s")


def _ms(pair: dict | None) -> str:
    return "—" if not pair else f"{pair['p50_ms']:.2f} / {pair['p99_ms']:.2f} ms"


def _added(row: dict, name: str) -> str:
    p50, p99 = row.get(f"{name}_added_p50_ms"), row.get(f"{name}_added_p99_ms")
    return "—" if p50 is None else f"{p50:.2f} / {p99:.2f} ms"


def render_quota_backends(data: dict, name: str) -> str:
    a = data["args"]
    lines = [caption(data, name, f"; Redis {'at ' + a['redis'] if a.get('redis') else 'started locally, AOF everysec'}"),
             "",
             "| load | requests per backend | Redis added, one round trip (the gateway's path): p50 / p99 "
             "| two steps (near a limit) | embedded alone | PING round trip | µs per EVALSHA in Redis "
             "| tokens billed in Redis = settled |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for key, row in data["results"].items():
        billed, settled = row.get("redis_billed_tokens"), row.get("redis_settled_tokens")
        exact = "—" if billed is None or settled is None else (
            f"yes ({billed:,})" if billed == settled else f"**no**: {billed:,} of {settled:,}")
        evalsha = row.get("server_us_per_evalsha")
        lines.append(f"| {load_label(key)} | {row['redis']['n']:,} | **{_added(row, 'redis')}** | "
                     f"{_added(row, 'redis_two_step')} | {_ms(row['embedded'].get('admit+settle'))} | "
                     f"{_ms(row.get('ping_round_trip'))} | {'—' if evalsha is None else f'{evalsha:.0f}'} | {exact} |")
    return "\n".join(lines)


RENDERERS = {"serving.quota_backends": render_quota_backends}
