"""The `streamgate serve` flags that bound what one client may cost the server
(docs/PROTOCOL.md, "Limits"), and where each goes: uvicorn's config or GatewaySettings."""

from __future__ import annotations

import argparse
import os


def limit_args(parser: argparse.ArgumentParser) -> None:
    """What one client may cost the server (docs/PROTOCOL.md, "Limits"), one `--help` group."""
    p = parser.add_argument_group("limits", 'what one client may cost the server (docs/PROTOCOL.md, "Limits")')
    p.add_argument("--max-frame-bytes", type=int, default=1 << 20, help="largest WebSocket frame (close 1009)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest HTTP request body (413)")
    p.add_argument("--max-sockets", type=int, default=1024, help="authenticated WebSockets, all tenants")
    p.add_argument("--max-unauthenticated-sockets", type=int, default=64,
                   help="WebSockets still authenticating (a separate pool)")
    p.add_argument("--max-sockets-per-tenant", type=int, default=64)
    p.add_argument("--max-stats-streams", type=int, default=4, help="stats streams per tenant (SSE + WebSocket)")
    p.add_argument("--ws-auth-timeout", type=float, default=5.0, help="seconds a WebSocket has to authenticate")
    p.add_argument("--ws-idle-timeout", type=float, default=300.0,
                   help="seconds a WebSocket may stay open with no frame and nothing running")
    p.add_argument("--tokenize-workers", type=int, default=2, help="threads for chat templates and tokenizing")
    p.add_argument("--tool-parser", choices=("hermes", "llama3_json", "mistral", "harmony"), default=None,
                   help="how tool calls are read from the model's output (default: from its chat template)")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="uvicorn: connections + tasks past which new ones get 503 (default: no limit)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="uvicorn: seconds an idle keep-alive HTTP connection stays open")
    p.add_argument("--timeout-headers", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers (slow or silent clients)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's whole body (408 past it)")
    p.add_argument("--max-json-values", type=int, default=100_000,
                   help="commas and brackets a body or frame may hold (bounds JSON decoding time)")
    p.add_argument("--max-unauthenticated-sockets-per-address", type=int, default=16,
                   help="WebSockets still authenticating from one client address (429 before the upgrade)")
    p.add_argument("--ws-keyless-rate", type=float, default=10.0,
                   help="WebSocket upgrades without a key per client address and second (0: no limit)")
    p.add_argument("--ws-keyless-burst", type=int, default=16, help="... and at once")
    p.add_argument("--max-connections-per-address", type=int, default=256,
                   help="open HTTP connections from one client address (429 past it; 0: no cap, e.g. behind a proxy)")
    p.add_argument("--ws-keyed-rate", type=float, default=20.0,
                   help="WebSocket upgrades with a valid key per tenant and second (0: no limit)")
    p.add_argument("--ws-keyed-burst", type=int, default=40, help="... and at once")
    p.add_argument("--ws-preauth-max-frame-bytes", type=int, default=4096,
                   help="largest WebSocket frame before authentication (close 1009)")
    p.add_argument("--ws-preauth-frame-rate", type=float, default=10.0,
                   help="frames per second a WebSocket may send before authenticating (close 1008)")
    p.add_argument("--ws-preauth-frame-burst", type=int, default=20, help="... and at once")
    p.add_argument("--ws-compression-max-bytes", type=int, default=0,
                   help="negotiate permessage-deflate, no message inflating past this many bytes "
                        "(default 0: compression off, so every byte limit counts the bytes processed)")
    p.add_argument("--allow-host", action="append", default=[],
                   help="a Host name the server answers (repeatable). Serving on a loopback address, only "
                        "localhost, 127.0.0.1 and ::1 are answered unless listed here (DNS rebinding)")
    p.add_argument("--metrics-token", default=os.environ.get("STREAMGATE_METRICS_TOKEN"),
                   help="bearer token /metrics requires (env STREAMGATE_METRICS_TOKEN; default: "
                        "/metrics answers only clients on this host)")
    p.add_argument("--write-timeout", type=float, default=30.0,
                   help="seconds a send to a client (SSE, WebSocket) may block before the connection is aborted")
    p.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                   help="uvicorn's event loop (auto: uvloop where installed)")
    p.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                   help="uvicorn's HTTP parser (auto: httptools where installed)")
    p.add_argument("--backlog", type=int, default=2048, help="the listen queue (connections not yet accepted)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the interpreter's GIL switch interval (default: Python's 5 ms)")


def server_limits(args: argparse.Namespace) -> dict:
    """The `_limit_args` flags that configure uvicorn (gateway.server.serve's keywords)."""
    return {"max_frame_bytes": args.max_frame_bytes, "limit_concurrency": args.limit_concurrency,
            "timeout_keep_alive": args.timeout_keep_alive, "timeout_headers": args.timeout_headers,
            "loop": args.loop, "http": args.http, "backlog": args.backlog, "ws_keyless_rate": args.ws_keyless_rate,
            "ws_keyless_burst": args.ws_keyless_burst, "switch_interval_ms": args.switch_interval_ms,
            "ws_compression_max_bytes": args.ws_compression_max_bytes, "ws_keyed_rate": args.ws_keyed_rate,
            "ws_keyed_burst": args.ws_keyed_burst, "max_connections_per_address": args.max_connections_per_address}


def settings_limits(args: argparse.Namespace) -> dict:
    """The `limit_args` flags that are GatewaySettings fields."""
    return dict(max_frame_bytes=args.max_frame_bytes, max_body_bytes=args.max_body_bytes,
                max_sockets=args.max_sockets, max_unauthenticated_sockets=args.max_unauthenticated_sockets,
                max_sockets_per_tenant=args.max_sockets_per_tenant, max_stats_streams_per_tenant=args.max_stats_streams,
                ws_auth_timeout_s=args.ws_auth_timeout, ws_idle_timeout_s=args.ws_idle_timeout,
                tokenize_workers=args.tokenize_workers, tool_parser=args.tool_parser,
                max_unauthenticated_sockets_per_address=args.max_unauthenticated_sockets_per_address,
                body_timeout_s=args.body_timeout, max_json_values=args.max_json_values,
                ws_preauth_max_frame_bytes=args.ws_preauth_max_frame_bytes,
                ws_preauth_frame_rate=args.ws_preauth_frame_rate, ws_preauth_frame_burst=args.ws_preauth_frame_burst,
                write_timeout_s=args.write_timeout, metrics_token=args.metrics_token or None,
                allowed_hosts=allowed_hosts(args))


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...]:
    """`--allow-host` names; on a loopback address the loopback names are always among them."""
    from .hosts import LOOPBACK_HOSTS

    listed = tuple(args.allow_host)
    loopback = getattr(args, "host", "") in ("127.0.0.1", "localhost", "::1") or str(getattr(args, "host", "")).startswith("127.")
    return (*LOOPBACK_HOSTS, *listed) if loopback else listed
