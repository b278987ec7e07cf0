"""`bench.isolation`'s flags (its timings and each attack's size, one table each) and the
parameters its attack processes get from them."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from bench.isolation.attacks import ATTACKS
from engine.config_cli import add_engine_args

LOOPBACK = ("127.0.0.1", "localhost", "::1")

# (flag, type, default, help) of the run's timings and of each attack's size.
TIMING_FLAGS = (
    ("--b-max-tokens", int, 400, "tokens per B answer (EOS ignored)"),
    ("--baseline", float, 8.0, "seconds of B alone"),
    ("--hold", float, 6.0, "seconds held attacks (sockets, streams) stay open"),
    ("--settle", float, 1.0, "seconds each window runs past its attack"),
    ("--attack-timeout", float, 120.0,
     "seconds an attack waits for an answer; its process is killed 30 s + --hold later"),
    ("--write-timeout", float, 3.0,
     "the started server's --write-timeout (stuck_readers: streams no one reads are cut after it)"),
)
SIZE_FLAGS = (
    ("--prompt-mb", float, 8.0, "big_prompt: prompt size (MB)"),
    ("--frames", int, 3, "big_frames: how many frames"),
    ("--frame-kib", int, 1000, "big_frames: frame size (KiB, keep under --max-frame-bytes)"),
    ("--stats-streams", int, 300, "stats_flood: GET /v1/stats streams"),
    ("--sockets", int, 1024, "keyless_ws: sockets opened with no key"),
    ("--body-mib", int, 200, "chunked_body: body size (MiB)"),
    ("--depth", int, 100_000, "deep_json: nesting depth"),
    ("--head-requests", int, 5000, "head_flood: HEAD /v1/stats requests"),
    ("--bomb-frames", int, 50, "deflate_bomb: inflating frames sent without a key"),
    ("--stuck-streams", int, 32, "stuck_readers: SSE streams that are never read"),
    ("--upgrades", int, 2000, "keyed_upgrades: upgrades with A's key"),
    ("--parse-requests", int, 200, "overquota_parse: ~1 MB bodies over quota"),
)


def attack_params(args, url: str, key_a: str, key_parse: str | None = None) -> dict:
    """`key_parse` (overquota_parse's key) is A's slow-quota tenant when this benchmark
    writes the tenants file; with --url, A's key."""
    return {"url": url, "key": key_a, "parse_key": key_parse or key_a, "prompt_mb": args.prompt_mb, "frames": args.frames,
            "frame_kib": args.frame_kib, "streams": args.stats_streams, "sockets": args.sockets,
            "body_mib": args.body_mib, "depth": args.depth, "hold_s": args.hold, "timeout_s": args.attack_timeout,
            "head_requests": args.head_requests, "bomb_frames": args.bomb_frames, "stuck_streams": args.stuck_streams,
            "upgrades": args.upgrades, "parse_requests": args.parse_requests}


def parse_args(argv: list[str] | None, description: str = "") -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    add_engine_args(p, only=("model",))
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated subset of: {', '.join(ATTACKS)}")
    p.add_argument("--server-args", default="", help="extra `streamgate serve` flags, one string")
    p.add_argument("--url", default=None, help="a running server on loopback instead of starting one")
    p.add_argument("--key-a", default=None, help="with --url: the attacking tenant's key")
    p.add_argument("--key-b", default=None, help="with --url: the victim tenant's key")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    p.add_argument("--shared-server", action="store_true",
                   help="run every attack on one server (faster; later attacks then see earlier ones' heap)")
    for flags, group in ((TIMING_FLAGS, p), (SIZE_FLAGS, p.add_argument_group("attack sizes"))):
        for flag, kind, default, text in flags:
            group.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--out", "--json-out", dest="out", default="bench/results/isolation.json")
    args = p.parse_args(argv)
    args.attacks = [a for a in args.attacks.split(",") if a]
    if unknown := [a for a in args.attacks if a not in ATTACKS]:
        p.error(f"--attacks: unknown {', '.join(unknown)} (known: {', '.join(ATTACKS)})")
    if args.url:
        if urlsplit(args.url).hostname not in LOOPBACK:
            p.error("--url: only a server on loopback (127.0.0.1, localhost, ::1) may be attacked")
        if not (args.key_a and args.key_b):
            p.error("--url needs --key-a and --key-b (two different tenants)")
    return args
