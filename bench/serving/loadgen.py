"""Serving workloads: a small TOML file → a fixed list of chat requests → a timed replay.

A workload file (see `bench/serving/workloads/*.toml`; the same file and seed always give the same
requests, prompts included):

    name = "mixed"
    seed = 0
    num_requests = 40        # upper bound on requests sent (both bounds apply)
    duration_s = 60          # upper bound on the arrival window (closed loop: on starting requests)
    arrival = "poisson"      # "poisson": open loop at `rate`; "closed": `users` in a loop
    rate = 1.0               # requests/s over all tenants (poisson); tenants split it by `share`
    users = 8                # closed loop: concurrent users, split across tenants by share
    think_s = 2.0            # closed loop: mean think time between answer and next request (exponential)
    server_args = "--max-num-seqs 8"   # engine flags for a server the bench starts (ignored with --url)

    [slo]
    ttft_ms = 2000           # a request meets the SLO when TTFT <= ttft_ms and TPOT <= tpot_ms
    tpot_ms = 300

    [[tenants]]              # at least one; default: one tenant "bench"
    name = "polite"
    rate = 0.3               # requests/s (or share = 0.2: a share of the global rate)
    priority = 0             # class; lower is served first
    weight = 1.0             # share under contention (fair policy)
    deadline_ms = 60000      # optional; sent with each request and set as the tenant's bound
    api_key = "sg-..."       # only with --url (else the bench makes keys and a tenants file)
    users = 4                # closed loop: this tenant's users (default: split by share)
    [[tenants.mix]]          # optional per-tenant mix; else the global [[mix]]
    ...

    [[mix]]                  # request classes, chosen by weight
    name = "chat"
    weight = 6
    prompt_words = [20, 150] # uniform; English-like text from bench.workload._text
    max_tokens = [32, 128]   # uniform; every request uses ignore_eos and temperature 0
    long = false             # long prompts: their arrivals are marked on the ITL-over-time plot
    instruction = ""         # text put before the generated words

Open loop: one Poisson process at the total rate; each arrival picks its tenant with
probability rate/total, so `--rate` scales every arrival time and keeps the prompts.
Closed loop: request i goes to user i mod users; a user sends its next request when the
previous answer ends plus its think time.
"""

from __future__ import annotations

import random
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.workload import _text

WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"


class WorkloadError(ValueError):
    """The workload file is invalid; the message names the field."""


@dataclass(frozen=True)
class Mix:
    name: str
    weight: float
    prompt_words: tuple[int, int]
    max_tokens: tuple[int, int]
    long: bool = False
    instruction: str = ""


@dataclass(frozen=True)
class TenantSpec:
    name: str
    rate: float | None = None
    share: float | None = None
    priority: int = 0
    weight: float = 1.0
    deadline_ms: int | None = None
    api_key: str | None = None
    users: int | None = None
    mix: tuple[Mix, ...] = ()


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int = 0
    num_requests: int = 40
    duration_s: float = 60.0
    arrival: str = "poisson"
    rate: float | None = None
    users: int = 4
    think_s: float = 0.0
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 300.0
    server_args: str = ""
    tenants: tuple[TenantSpec, ...] = ()
    mix: tuple[Mix, ...] = ()

    def tenant_rates(self) -> dict[str, float]:
        """Requests/s per tenant: its own `rate`, else its share of the global rate."""
        even = 1.0 / len(self.tenants)
        share = {t.name: t.share if t.share is not None else even for t in self.tenants}
        return {t.name: t.rate if t.rate is not None else share[t.name] * (self.rate or 0.0) for t in self.tenants}

    def with_rate(self, total: float) -> Workload:
        """The same workload with every tenant's rate scaled so they sum to `total`."""
        rates = self.tenant_rates()
        factor = total / sum(rates.values())
        return replace(self, rate=total, tenants=tuple(replace(t, rate=rates[t.name] * factor, share=None)
                                                       for t in self.tenants))


@dataclass(frozen=True)
class Req:
    id: str
    tenant: str
    cls: str
    at: float | None          # scheduled arrival (s from start); None in a closed loop
    user: int | None
    think_s: float
    messages: list = field(hash=False)
    prompt_words: int = 0
    max_tokens: int = 16
    priority: int = 0
    weight: float = 1.0
    deadline_ms: int | None = None
    long: bool = False
    extra: dict | None = field(default=None, hash=False)    # more body fields (drivers.chat_body)


def _need(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise WorkloadError(f"{where}: {msg}")


def _range(where: str, v) -> tuple[int, int]:
    _need(isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and x > 0 for x in v) and v[0] <= v[1],
          where, f"must be [lo, hi] with 0 < lo <= hi (got {v!r})")
    return int(v[0]), int(v[1])


def _mixes(where: str, raw) -> tuple[Mix, ...]:
    _need(isinstance(raw, list), where, "must be an array of tables ([[mix]])")
    out = []
    for i, m in enumerate(raw):
        w = f"{where}[{i}]"
        _need(isinstance(m, dict) and isinstance(m.get("name"), str), w, "needs a name")
        _need(m.get("weight", 1) > 0, f"{w}.weight", "must be > 0")
        out.append(Mix(m["name"], float(m.get("weight", 1)), _range(f"{w}.prompt_words", m.get("prompt_words")),
                       _range(f"{w}.max_tokens", m.get("max_tokens")), bool(m.get("long", False)),
                       str(m.get("instruction", ""))))
    return tuple(out)


def load_workload(name_or_path: str) -> Workload:
    """A workload by name (`bench/serving/workloads/<name>.toml`) or by path."""
    path = Path(name_or_path)
    if not path.exists():
        path = WORKLOADS_DIR / f"{name_or_path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        known = ", ".join(sorted(p.stem for p in WORKLOADS_DIR.glob("*.toml")))
        raise WorkloadError(f"{name_or_path}: no such workload file (known: {known})") from None
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: invalid TOML ({exc})") from None
    mix = _mixes("mix", data.get("mix", []))
    tenants = []
    for i, t in enumerate(data.get("tenants", [{"name": "bench"}])):
        w = f"tenants[{i}]"
        _need(isinstance(t, dict) and isinstance(t.get("name"), str), w, "needs a name")
        tmix = _mixes(f"{w}.mix", t.get("mix", []))
        _need(bool(tmix or mix), f"{w}.mix", "no [[mix]] classes for this tenant and no global [[mix]]")
        for k in ("rate", "share", "weight"):
            _need(t.get(k) is None or t[k] > 0, f"{w}.{k}", f"must be > 0 (got {t.get(k)!r})")
        tenants.append(TenantSpec(t["name"], t.get("rate"), t.get("share"), int(t.get("priority", 0)),
                                  float(t.get("weight", 1.0)), t.get("deadline_ms"), t.get("api_key"),
                                  t.get("users"), tmix))
    _need(len({t.name for t in tenants}) == len(tenants), "tenants", "tenant names must be unique")
    slo = data.get("slo", {})
    wl = Workload(name=data.get("name", path.stem), seed=int(data.get("seed", 0)),
                  num_requests=int(data.get("num_requests", 40)), duration_s=float(data.get("duration_s", 60.0)),
                  arrival=data.get("arrival", "poisson"), rate=data.get("rate"), users=int(data.get("users", 4)),
                  think_s=float(data.get("think_s", 0.0)), slo_ttft_ms=float(slo.get("ttft_ms", 2000)),
                  slo_tpot_ms=float(slo.get("tpot_ms", 300)), server_args=str(data.get("server_args", "")),
                  tenants=tuple(tenants), mix=mix)
    _need(wl.arrival in ("poisson", "closed"), "arrival", f"must be 'poisson' or 'closed' (got {wl.arrival!r})")
    _need(wl.num_requests > 0 and wl.duration_s > 0, "num_requests/duration_s", "must both be > 0")
    _need(wl.arrival == "closed" or all(t.rate or wl.rate for t in tenants), "rate",
          "poisson arrivals need a global rate or a rate per tenant")
    return wl


def make_requests(wl: Workload, offline: bool = False) -> list[Req]:
    """The workload's requests in arrival order (deterministic for a given workload)."""
    rng = random.Random(wl.seed)
    rates = wl.tenant_rates()
    total = sum(rates.values())
    names = [t.name for t in wl.tenants]
    specs = {t.name: t for t in wl.tenants}
    if wl.arrival == "closed":
        users = _user_tenants(wl)
    reqs, t = [], 0.0
    for i in range(wl.num_requests):
        if wl.arrival == "poisson":
            t += rng.expovariate(total)
            if t > wl.duration_s:
                break
            tenant = specs[rng.choices(names, weights=[rates[n] for n in names])[0]]
            user, at = None, (0.0 if offline else t)
        else:
            user, at = i % len(users), None
            tenant = specs[users[user]]
        classes = tenant.mix or wl.mix
        cls = rng.choices(classes, weights=[c.weight for c in classes])[0]
        words = rng.randint(*cls.prompt_words)
        text = (cls.instruction + "\n\n" if cls.instruction else "") + _text(rng, words)
        think = rng.expovariate(1 / wl.think_s) if wl.think_s > 0 else 0.0
        reqs.append(Req(f"{wl.name}-{i}", tenant.name, cls.name, at, user, think,
                        [{"role": "user", "content": text}], words, rng.randint(*cls.max_tokens),
                        tenant.priority, tenant.weight, tenant.deadline_ms, cls.long))
    return reqs


def _user_tenants(wl: Workload) -> list[str]:
    """Closed loop: the tenant of each user (its own `users`, else split by share)."""
    fixed = {t.name: t.users for t in wl.tenants if t.users}
    rest = [t for t in wl.tenants if not t.users]
    left = max(0, wl.users - sum(fixed.values()))
    weights = [t.share or 1.0 for t in rest]
    counts = dict(fixed)
    for t, w in zip(rest, weights):
        counts[t.name] = max(1, round(left * w / sum(weights)))
    return [name for t in wl.tenants for name in [t.name] * counts[t.name]]
