"""The tenant-isolation benchmark: a short real run on a tiny model (every attack, small
sizes), plus the window arithmetic and the loopback guard on their own."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench.isolation.run import parse_args, server_groups
from bench.isolation.report import check_targets
from bench.isolation.attacks import ATTACKS
from bench.isolation.victim import Victim

SMALL = ["--b-max-tokens", "32", "--baseline", "1", "--hold", "0.5", "--settle", "0.3", "--attack-timeout", "60",
         "--prompt-mb", "0.2", "--frames", "2", "--frame-kib", "64", "--stats-streams", "12", "--sockets", "24",
         "--body-mib", "3", "--depth", "20000", "--head-requests", "60", "--bomb-frames", "3", "--stuck-streams", "4",
         "--upgrades", "30", "--parse-requests", "6", "--write-timeout", "1", "--shared-server"]


def test_isolation_bench_measures_every_attack(tiny_model, tmp_path):
    """Every attack gets a phase with real measurements of B (chunks, gaps, /health polls,
    the server's RSS, a WebSocket probe), what A got back, and a PASS/MISS per target."""
    out = tmp_path / "iso.json"
    proc = subprocess.run([sys.executable, "-m", "bench.isolation", "--model", tiny_model("llama"), "--out", str(out),
                           *SMALL], capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    phases = res["phases"]
    assert list(phases) == ["baseline", *ATTACKS]
    base = phases["baseline"]
    assert base["chunks"] > 0 and base["health_polls"] > 0
    assert 0 < base["gap_p50_ms"] <= base["gap_max_ms"] < 60_000
    assert 0 < base["health_max_ms"] < 30_000 and base["rss_before_mb"] > 0 and base["loop_cpu_ms"] >= 0
    assert base["b_ws"]["connected"] is True
    for name in ATTACKS:
        ph = phases[name]
        assert ph["window_s"] > 0 and ph["gap_max_ms"] is not None and ph["health_polls"] > 0, name
        assert isinstance(ph["rss_growth_mb"], float) and isinstance(ph["b_ws"]["connected"], bool), name
        outcome = ph["attacker"]["outcome"]
        assert outcome and not outcome.startswith(("attack failed", "the attack")), name
        assert 0 <= ph["log"]["error_lines"] <= ph["log"]["lines"], name
    # what A got back is the server's answer, whatever the gateway's limits are today
    assert 400 <= phases["big_prompt"]["attacker"]["status"] < 500
    assert 400 <= phases["chunked_body"]["attacker"]["status"] < 500
    assert sum(phases["stats_flood"]["attacker"]["statuses"].values()) == 12
    keyless = phases["keyless_ws"]["attacker"]
    assert keyless["opened"] + sum(keyless["failed"].values()) == 24
    assert sum(phases["head_flood"]["attacker"]["statuses"].values()) == 60
    assert sum(phases["keyed_upgrades"]["attacker"]["results"].values()) == 30
    assert phases["deflate_bomb"]["attacker"]["extensions"] == []          # compression is off by default
    over = phases["overquota_parse"]["attacker"]["statuses"]
    assert over == {"429 requests_per_minute": 6}, over                     # refused from the headers
    stuck = phases["stuck_readers"]["attacker"]
    assert stuck["held"] >= 1 and "still open" not in stuck["ends"], stuck    # none held after the write timeout
    for name in ATTACKS:
        assert phases[name]["idle_after_s"] is not None, name               # every gauge back to idle
    frames = phases["big_frames"]["attacker"]
    assert len(frames["answers"]) == 2 or frames["close_code"] is not None
    targets = res["targets"]
    assert targets["gap_limit_ms"] == max(250.0, 3 * base["gap_max_ms"])
    assert set(targets["attacks"]) == set(ATTACKS)
    for checks in targets["attacks"].values():
        assert set(checks) == {"gap", "health", "rss", "ws", "idle"} and set(checks.values()) <= {"PASS", "MISS"}
    for name in ATTACKS:
        assert any(line.startswith(name) and ("PASS" in line or "MISS" in line) for line in proc.stdout.splitlines())


def test_window_counts_gaps_that_overlap_it():
    """A gap counts in a window if it overlaps it, and a stall still open at the end of the
    run is measured up to the end; polls and RSS are taken from inside the window."""
    v = Victim("http://127.0.0.1:1", "k", None, 8)
    v.chunks = [0.0, 0.1, 0.2, 1.2, 1.3, 1.4, 2.1, 2.2]
    v.polls = [(0.05, 0.01, False), (1.0, 0.5, True), (3.0, 0.02, False)]
    v.rss = [(0.0, 100_000_000), (1.1, 350_000_000), (2.5, 120_000_000)]
    v.loop_cpu = [(0.5, 1.0), (1.2, 1.3), (1.9, 1.8), (2.5, 3.0)]
    s = v.summary(1.0, 2.0, t_end=4.0)
    assert s["loop_cpu_ms"] == 500                            # the loop's CPU between samples inside [1, 2]
    assert s["gap_max_ms"] == pytest.approx(1000.0)          # 0.2 -> 1.2 overlaps [1, 2]
    assert s["gap_max_from_s"] == pytest.approx(-0.8)         # it began before the window
    assert s["health_max_ms"] == pytest.approx(500.0) and s["health_polls"] == 1 and s["health_timeouts"] == 1
    assert s["rss_before_mb"] == pytest.approx(100.0) and s["rss_growth_mb"] == pytest.approx(250.0)
    tail = v.summary(2.15, 3.5, t_end=4.0)
    assert tail["gap_max_ms"] == pytest.approx(1800.0)       # 2.2 -> end of run: B never got another chunk
    assert math.isclose(tail["window_s"], 1.35)


def test_targets_use_the_baseline_or_250_ms():
    """The gap limit is max(250 ms, 3x B's baseline gap); each target is PASS or MISS."""
    phase = {"gap_max_ms": 400.0, "health_max_ms": 50.0, "rss_growth_mb": 150.0, "b_ws": {"connected": False},
             "idle_after_s": 0.4}
    for base, verdict in ((100.0, "MISS"), (200.0, "PASS")):
        t = check_targets({"baseline": {"gap_max_ms": base}, "x": phase})
        assert t["gap_limit_ms"] == max(250.0, 3 * base)
        assert t["attacks"]["x"] == {"gap": verdict, "health": "PASS", "rss": "MISS", "ws": "MISS", "idle": "PASS"}
    assert check_targets({"baseline": {"gap_max_ms": 100.0}, "x": {**phase, "idle_after_s": None}}
                         )["attacks"]["x"]["idle"] == "MISS"


def test_only_loopback_servers_are_attacked():
    """--url must point at loopback, and needs both tenants' keys."""
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://192.0.2.1:8000", "--key-a", "a", "--key-b", "b"])
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://127.0.0.1:8000", "--key-a", "a"])
    assert parse_args(["--url", "http://localhost:8000", "--key-a", "a", "--key-b", "b"]).url


def test_each_attack_gets_a_fresh_server_unless_shared():
    """By default the baseline shares a server with the first attack and every other attack
    gets its own; --shared-server (and --url) run everything on one."""
    args = parse_args(["--attacks", "big_prompt,keyless_ws,deep_json"])
    assert server_groups(args) == [["baseline", "big_prompt"], ["keyless_ws"], ["deep_json"]]
    shared = parse_args(["--attacks", "big_prompt,keyless_ws", "--shared-server"])
    assert server_groups(shared) == [["baseline", "big_prompt", "keyless_ws"]]


def test_raw_post_sees_an_answer_sent_before_the_body_is_read():
    """A server that answers 413 after the headers and closes (as a body cap does) is reported
    as 413 with its error code, not as a write error, and the body is not sent in full."""
    import asyncio

    from bench.isolation.client import MiB, raw_post

    async def refuse(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"error": {"message": "too big", "code": "body_too_large"}}'
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        writer.close()

    async def run():
        srv = await asyncio.start_server(refuse, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        sent = []
        async with srv:
            r = await raw_post(f"http://127.0.0.1:{port}", "k", [b"x" * MiB] * 64, length=64 * MiB,
                               timeout_s=10, on_sent=lambda: sent.append(True))
        return r, sent

    r, sent = asyncio.run(run())
    assert r["status"] == 413 and r["code"] == "body_too_large"
    assert r["body_sent_mib"] < 64 and not sent


def test_an_error_without_id_ends_the_request_it_answers():
    """Each request ends with one terminal event; one the server could not tie to an id (it
    answers `"id": null`) still counts, so the attacker stops waiting at once."""
    import asyncio
    import json
    import time

    from websockets.asyncio.server import serve

    from bench.isolation.client import request_outcomes

    async def handler(ws):
        await ws.send(json.dumps({"type": "error", "id": None, "error": {"code": "invalid_json"}}))
        await ws.send(json.dumps({"type": "chat.done", "id": "other", "finish_reason": "length"}))
        await ws.wait_closed()

    async def run():
        from websockets.asyncio.client import connect

        async with serve(handler, "127.0.0.1", 0) as srv:
            port = srv.sockets[0].getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}") as ws:
                t0 = time.monotonic()
                got, code = await request_outcomes(ws, {"deep", "other"}, timeout_s=30)
                return got, code, time.monotonic() - t0

    got, code, waited = asyncio.run(run())
    assert got == {"error(id=None)#0": "invalid_json", "other": "length"} and code is None
    assert waited < 5


def test_the_recorded_command_leaves_keys_out():
    """The command line written to the JSON hides --key-a / --key-b values in both spellings."""
    from bench.isolation.run import command_line

    line = command_line(["--url", "http://127.0.0.1:8000", "--key-a", "sg-secret1", "--key-b=sg-secret2", "--hold", "2"])
    assert "sg-secret" not in line
    assert line == "python -m bench.isolation --url http://127.0.0.1:8000 --key-a '<key>' '--key-b=<key>' --hold 2"
