"""Tenant isolation (issue 10): tenant B streams back to back while tenant A (or a client
with no key) attacks the gateway, one attack at a time.

    python -m bench.isolation                                   # default model, every attack
    python -m bench.isolation --attacks big_prompt,keyless_ws   # a subset
    python -m bench.isolation --server-args "--max-frame-bytes 2097152" --frame-kib 2000
    python -m bench.isolation --url http://127.0.0.1:8000 --key-a sg-... --key-b sg-... [--server-pid PID]

By default it starts its own `streamgate serve` on 127.0.0.1 with three tenants:
`attacker` (A: max_concurrent 4, 120 requests/min, max_tokens 256), `victim` (B:
max_concurrent 16, 600 requests/min) and `attacker_parse`, A's key for overquota_parse (1
request/min, so its bucket does not refill during the attack on any host); a fresh server
for each attack (the first one also runs the baseline), or one for all with
`--shared-server`. B streams `--b-max-tokens`-token answers over SSE, one after another,
for the whole run. First B runs alone (the baseline), then each attack runs in a process
of its own (bench/isolation/attacks.py) while B keeps streaming. Per phase it reports B's
largest and median inter-chunk gap (one timeline across B's requests, so a stall between
two requests counts too), the slowest /health answer (polled every 100 ms on a fresh
connection), the server's peak RSS growth (VmRSS from /proc), whether B could open a
WebSocket while the attack was in place, error-level lines the server logged, and what A
got back. Then the issue's targets, PASS or MISS: B's largest gap <= max(250 ms, 3x its
baseline), /health <= 100 ms, RSS growth <= 100 MB, B's WebSocket connects.

All traffic goes to loopback; every attack is bounded in size, count and time, and its
process is killed if it outlives `--attack-timeout` + `--hold` + 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench import server
from bench.provenance import provenance, write_json
from bench.isolation import options
from bench.isolation.options import attack_params
from bench.isolation.report import check_targets, report
from bench.isolation.victim import Victim, probe_ws


def write_tenants(path: Path) -> tuple[str, str, str]:
    """A tenants file with A (the attacker), B (the victim) and A's tenant for
    overquota_parse (1 request a minute, so its bucket stays empty for the whole attack on
    any host); returns their keys."""
    from tenants import hash_key, new_key

    key_a, key_b, key_parse = new_key(), new_key(), new_key()
    path.write_text(f"""[tenants.attacker]
api_key_sha256 = ["{hash_key(key_a)}"]
max_concurrent = 4
requests_per_minute = 120
max_tokens = 256

[tenants.victim]
api_key_sha256 = ["{hash_key(key_b)}"]
max_concurrent = 16
requests_per_minute = 600
max_tokens = 1024

[tenants.attacker_parse]
api_key_sha256 = ["{hash_key(key_parse)}"]
max_concurrent = 4
requests_per_minute = 1
max_tokens = 256
""")
    return key_a, key_b, key_parse


class LogWatch:
    """Lines the server logged during a phase (only when this benchmark started the server)."""

    def __init__(self, path: Path | None):
        self.path, self.offset = path, 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path else 0

    def since_mark(self) -> dict | None:
        if self.path is None:
            return None
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            lines = f.read().decode(errors="replace").splitlines()
        errors = [ln for ln in lines if '"level": "error"' in ln or '"level": "critical"' in ln
                  or ln.startswith("Traceback")]
        return {"lines": len(lines), "error_lines": len(errors)}


async def run_attack(name: str, params: dict, url: str, key_b: str, settle_s: float, timeout_s: float) -> dict:
    """Run one attack in its own process; probe B's WebSocket once the attack is in place.
    The window runs from the attack's start until `settle_s` after it ended."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                      os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as err:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.isolation.attacks", name,
                                                    json.dumps(params), stdout=asyncio.subprocess.PIPE,
                                                    stderr=err, env=env)
        probe, result = None, None
        try:
            async with asyncio.timeout(timeout_s):
                while result is None and (line := await proc.stdout.readline()):
                    msg = json.loads(line)
                    t0 = msg.get("start", t0)
                    if "ready" in msg:
                        probe = asyncio.ensure_future(probe_ws(url, key_b))
                    result = msg.get("result")
                await proc.wait()
        except TimeoutError:
            result = {"outcome": f"the attack outlived {timeout_s:g} s and was killed"}
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        if result is None:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            result = {"outcome": f"the attacker exited {proc.returncode}: {tail[0][:200]}"}
    probe = probe or asyncio.ensure_future(probe_ws(url, key_b))
    await asyncio.sleep(settle_s)
    t1 = time.monotonic()
    return {"t0": t0, "t1": t1, "attacker": result, "b_ws": await probe, "idle_after_s": await idle_after(url, t1)}


async def idle_after(url: str, since: float, wait_s: float = 15.0) -> float | None:
    """Seconds after `since` until the gateway's gauges are back to idle (no WebSocket open,
    at most B's own stream), read from /metrics; None if not within `wait_s`."""
    import httpx

    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() - since < wait_s:
            try:
                text = (await client.get(f"{url}/metrics")).text
            except httpx.HTTPError:
                text = ""
            values = {}
            for line in text.splitlines():
                name = line.split("{")[0].split(" ")[0]
                if name in ("streamgate_gateway_open_streams", "streamgate_gateway_open_websockets"):
                    values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            if values and values.get("streamgate_gateway_open_websockets", 0) == 0 and \
                    values.get("streamgate_gateway_open_streams", 0) <= 1:
                return round(time.monotonic() - since, 2)
            await asyncio.sleep(0.2)
    return None


async def run_phases(args, names: list[str], url: str, keys: tuple[str, str, str | None], pid: int | None,
                     log: Path | None) -> dict:
    """The phases `names` (the baseline and/or attacks) on one server, B streaming throughout.
    `keys`: A's, B's and overquota_parse's (None: A's)."""
    key_a, key_b, key_parse = keys
    victim = Victim(url, key_b, pid, args.b_max_tokens)
    victim.start()
    logs = LogWatch(log)
    phases: dict[str, dict] = {}
    try:
        await victim.warm()
        params = attack_params(args, url, key_a, key_parse)
        for name in names:
            print(f"B is streaming; {name}", file=sys.stderr, flush=True)
            logs.mark()
            load = os.getloadavg()[0]
            if name == "baseline":
                t0 = time.monotonic()
                await asyncio.sleep(args.baseline / 2)
                probe = await probe_ws(url, key_b)
                await asyncio.sleep(max(0.0, t0 + args.baseline - time.monotonic()))
                phases[name] = {"t0": t0, "t1": time.monotonic(), "attacker": None, "b_ws": probe}
            else:
                limit = args.attack_timeout + args.hold + 30
                phases[name] = await run_attack(name, params, url, key_b, args.settle, limit)
            phases[name].update(log=logs.since_mark(), loadavg_1m=load)
        t_end = time.monotonic()
    finally:
        await victim.stop()
    return {name: {**victim.summary(ph.pop("t0"), ph.pop("t1"), t_end), **ph} for name, ph in phases.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return options.parse_args(argv, description=__doc__.split("\n\n")[0])


def server_groups(args) -> list[list[str]]:
    """Which phases share a server. By default each attack gets a fresh one (the first shares
    it with the baseline): a heap grown by one attack, or its stuck tasks, would otherwise
    hide the next attack's RSS growth and add to its gaps."""
    names = ["baseline", *args.attacks]
    if args.url or args.shared_server:
        return [names]
    return [names[:2], *([a] for a in names[2:])]


def run_group(args, names: list[str], tmp: Path) -> tuple[dict, bool]:
    """Run `names` on the given --url, or on a server of our own; returns (phases, whether
    the server exited by itself meanwhile)."""
    if args.url:
        url = args.url.rstrip("/")
        return asyncio.run(run_phases(args, names, url, (args.key_a, args.key_b, None), args.server_pid, None)), False
    keys = write_tenants(tmp / "tenants.toml")
    log = tmp / f"server-{names[-1]}.log"
    proc, url = server.launch([*server_flags(args), "--tenants", str(tmp / "tenants.toml"),
                               "--ledger", str(tmp / f"usage-{names[-1]}.sqlite3"), "--drain-grace", "2"], log)
    try:
        phases = asyncio.run(run_phases(args, names, url, keys, proc.pid, log))
        return phases, proc.poll() is not None
    finally:
        server.stop(proc)


def server_flags(args) -> list[str]:
    return ["--model", args.model, "--write-timeout", str(args.write_timeout), *shlex.split(args.server_args)]


def shown_argv(argv: list[str]) -> list[str]:
    """ARGV as recorded in the JSON, with API keys left out."""
    secret = ("--key-a", "--key-b")
    return ["<key>" if prev in secret else (a.split("=")[0] + "=<key>" if a.startswith(secret) and "=" in a else a)
            for prev, a in zip([None, *argv], argv)]


def command_line(argv: list[str]) -> str:
    """The command as run, for the JSON, with API keys left out."""
    return shlex.join(["python", "-m", "bench.isolation", *shown_argv(argv)])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prov = provenance("isolation", shown_argv(sys.argv[1:] if argv is None else argv))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)      # the server inherits it: 1024+ sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    phases: dict[str, dict] = {}
    crashed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="streamgate-isolation-") as tmp:
        for names in server_groups(args):
            got, exited = run_group(args, names, Path(tmp))
            phases.update(got)
            crashed += names if exited else []
    targets = check_targets(phases)
    print("\n".join(report(phases, targets)))
    if crashed:
        print(f"the server exited by itself during: {', '.join(crashed)}")
    path = write_json(args.out, prov, server={"url": args.url, "flags": None if args.url else server_flags(args),
                                              "exited_during": crashed},
                      args={k: v for k, v in vars(args).items() if k not in ("key_a", "key_b")}, phases=phases,
                      targets=targets)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
