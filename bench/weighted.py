"""Weighted service per tenant, as VTC counts it (issue 11: "within 5 % of 2:1").

The fair policy charges a tenant prompt tokens x1 and output tokens x2, divided by its
weight (engine/policy.py, `FairPolicy`), and promises equal charged service only between
tenants that are backlogged. So the split is read over the window in which every tenant
still had work outstanding: from the run's start to the first time one of a tenant's users
ran out of requests (the end of that user's last request; an open loop's tenant counts as
one user, so its window ends with its last request). In a closed loop with no think time
every user has a request in flight all that while.

From the client's records: a request's prompt counts once, when its first token arrived
(the engine charges it when it schedules the prefill, a step or a few before; a recompute
after a preemption is not charged, and is not counted here either); output tokens count
at their delta's time. The server's own counters (`tenant_served_tokens`) say the same
but only as totals, so this is what can be cut at the window's end.
"""

from __future__ import annotations

import math

from engine.policy import FairPolicy


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


def weighted_service(recs: list[dict], weights: dict[str, float]) -> dict:
    """Per tenant: prompt and output tokens served up to `backlogged_until`, the weighted
    service (prompt + 2 x output) raw and over its weight; and the split between the
    heaviest and the lightest tenant against their weight ratio (`error` = split / target
    - 1: 0 is exact)."""
    until = backlogged_until(recs)
    out = {"until_s": until, "tenants": {}}
    if until is None:
        return out
    for name in sorted({r["tenant"] for r in recs}):
        mine = [r for r in recs if r["tenant"] == name]
        prompt = sum(r["prompt_tokens"] or 0 for r in mine if r["deltas"] and r["deltas"][0][0] <= until)
        output = sum(n for r in mine for t, n in r["deltas"] if t <= until)
        service = FairPolicy.INPUT_COST * prompt + FairPolicy.OUTPUT_COST * output
        w = weights.get(name, 1.0)
        out["tenants"][name] = {"weight": w, "prompt_tokens": prompt, "output_tokens": output,
                                "service": service, "per_weight": service / w}
    by_weight = sorted(out["tenants"], key=lambda t: (-out["tenants"][t]["weight"], t))
    if len(by_weight) > 1 and out["tenants"][by_weight[-1]]["service"] > 0:
        hi, lo = out["tenants"][by_weight[0]], out["tenants"][by_weight[-1]]
        split, target = hi["service"] / lo["service"], hi["weight"] / lo["weight"]
        out.update(pair=[by_weight[0], by_weight[-1]], split=split, target=target, error=split / target - 1)
    return out


def describe(ws: dict) -> str:
    """One table cell: the split against its target, and the window."""
    if "split" not in ws:
        return "-"
    a, b = ws["pair"]
    return (f"{a}:{b} {ws['split']:.2f} (target {ws['target']:g}, {ws['error']:+.1%}) "
            f"to {ws['until_s']:.0f} s")
