"""Weighted service per tenant, as VTC counts it (issue 11: "within 5 % of 2:1").

The fair policy charges a tenant prompt tokens x1 and output tokens x2, divided by its
weight (engine/policy.py, `FairPolicy`), and promises equal charged service only between
tenants that are backlogged. So the split is read over the window in which every tenant
still had work outstanding: from the run's start to the first time one of a tenant's users
ran out of requests (the end of that user's last request; an open loop's tenant counts as
one user, so its window ends with its last request). In a closed loop with no think time
every user has a request in flight all that while.

Two counts of the same thing, side by side:
- `server`: the engine's own per-tenant counters (`tenant_served_tokens`: prompt tokens
  as billed, so a recompute after a preemption is free, and output tokens as sampled),
  sampled during the run (`ServedSampler`: `GET /metrics` of a server, `stats()` of an
  in-process engine) and read at the last sample within the window, less the first
  (the warm-up request is before it);
- `client`: the records alone: a request's prompt counts once, when its first token
  arrived (the engine charges it when it schedules the prefill, a step or a few before),
  output tokens at their delta's time. What a run against any server can say.
"""

from __future__ import annotations

import asyncio
import math
import re
import sys
import time

from engine.policy import FairPolicy

_SERVED = re.compile(r"^streamgate_tenant_served_tokens_total\{([^}]*)\} (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def backlogged_until(recs: list[dict]) -> float | None:
    """The end of the window in which every tenant had work outstanding (module doc);
    None when nothing was sent. A request that never ended (time limit) was outstanding
    to the end of the run."""
    last: dict[tuple, dict] = {}
    for r in recs:
        if r["send"] is not None:
            k = (r["tenant"], r["user"])
            if k not in last or r["send"] > last[k]["send"]:
                last[k] = r
    if not last:
        return None
    until = min(math.inf if r["end"] is None else r["end"] for r in last.values())
    if math.isinf(until):
        until = max((t for r in recs for t, _ in r["deltas"]), default=0.0)
    return until


def client_tokens(recs: list[dict], until: float) -> dict[str, tuple[int, int]]:
    """Per tenant, (prompt, output) tokens served by `until`, from the records alone."""
    out = {}
    for name in sorted({r["tenant"] for r in recs}):
        mine = [r for r in recs if r["tenant"] == name]
        out[name] = (sum(r["prompt_tokens"] or 0 for r in mine if r["deltas"] and r["deltas"][0][0] <= until),
                     sum(n for r in mine for t, n in r["deltas"] if t <= until))
    return out


def server_tokens(samples: list[dict], until: float) -> dict[str, tuple[float, float]] | None:
    """Per tenant, (prompt, output) tokens the server counted from the first sample to the
    last one at or before `until`; None without two such samples."""
    within = [s for s in samples if s["t"] <= until]
    if len(within) < 2:
        return None
    first, last = within[0]["served"], within[-1]["served"]
    return {t: (inp - first.get(t, (0, 0))[0], outp - first.get(t, (0, 0))[1]) for t, (inp, outp) in last.items()}


def split(tokens: dict[str, tuple[float, float]], weights: dict[str, float]) -> dict:
    """Per tenant: the weighted service (prompt x1 + output x2) raw and over its weight; and
    the split between the heaviest and the lightest tenant against their weight ratio
    (`error` = split / target - 1: 0 is exact)."""
    tenants = {}
    for name, (prompt, output) in sorted(tokens.items()):
        service = FairPolicy.INPUT_COST * prompt + FairPolicy.OUTPUT_COST * output
        w = weights.get(name, 1.0)
        tenants[name] = {"weight": w, "prompt_tokens": prompt, "output_tokens": output,
                         "service": service, "per_weight": service / w}
    out: dict = {"tenants": tenants}
    by_weight = sorted(tenants, key=lambda t: (-tenants[t]["weight"], t))
    if len(by_weight) > 1 and tenants[by_weight[-1]]["service"] > 0:
        hi, lo = tenants[by_weight[0]], tenants[by_weight[-1]]
        ratio, target = hi["service"] / lo["service"], hi["weight"] / lo["weight"]
        out.update(pair=[by_weight[0], by_weight[-1]], split=ratio, target=target, error=ratio / target - 1)
    return out


def weighted_service(recs: list[dict], weights: dict[str, float], served: list[dict] | None = None) -> dict:
    """The window's end (`until_s`) and the split there, by the client's count and, given
    the run's `ServedSampler` samples, by the server's (None if it has too few)."""
    until = backlogged_until(recs)
    if until is None:
        return {"until_s": None, "client": {"tenants": {}}, "server": None}
    server = server_tokens(served or [], until)
    server = {t: v for t, v in (server or {}).items() if t in weights} or None    # the workload's tenants
    return {"until_s": until, "client": split(client_tokens(recs, until), weights),
            "server": split(server, weights) if server is not None else None}


async def read_served(driver, client) -> dict[str, tuple[float, float]]:
    """The engine's per-tenant (prompt, output) counters now: an in-process engine's
    `stats()`, else the server's `GET /metrics` (`client`: an httpx.AsyncClient)."""
    if hasattr(driver, "eng"):
        return {t: tuple(v) for t, v in (await driver.eng.stats()).tenant_served_tokens.items()}
    served: dict[str, tuple[float, float]] = {}
    for labels, value in _SERVED.findall((await client.get(f"{driver.url}/metrics")).text):
        tags = dict(_LABEL.findall(labels))
        inp, outp = served.get(tags["tenant"], (0.0, 0.0))
        served[tags["tenant"]] = (float(value), outp) if tags["kind"] == "input" else (inp, float(value))
    return served


class ServedSampler:
    """`async with ServedSampler(driver, samples, t0):` around a run appends
    {"t", "served": read_served(...)} to `samples`: a baseline on entry (before any request),
    one every `interval_s`, and one on a clean exit (after the last request)."""

    def __init__(self, driver, samples: list[dict], t0: float, interval_s: float = 0.5):
        self.driver, self.samples, self.t0, self.interval_s = driver, samples, t0, interval_s

    async def _sample(self) -> bool:
        import httpx

        try:
            self.samples.append({"t": time.perf_counter() - self.t0, "served": await read_served(self.driver, self.client)})
            return True
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            print(f"warning: served-token sampling failed: {exc!r}", file=sys.stderr)
            return False

    async def _loop(self) -> None:
        while await self._sample():
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self):
        import httpx

        self.client = httpx.AsyncClient(timeout=10)
        await self._sample()
        self.task = asyncio.ensure_future(self._loop())
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if exc_type is None:
            await self._sample()
        await self.client.aclose()


def describe(ws: dict, source: str = "client") -> str:
    """One table cell: the split against its target, and the window."""
    x = ws.get(source) or {}
    if "split" not in x:
        return "-"
    a, b = x["pair"]
    return f"{a}:{b} {x['split']:.2f} (target {x['target']:g}, {x['error']:+.1%}) to {ws['until_s']:.0f} s"
