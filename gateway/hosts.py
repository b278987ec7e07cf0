"""A Host header allowlist (DNS rebinding): a page on another site whose name is made to
resolve to 127.0.0.1 reaches a loopback server as a *same-origin* page (Origin and Host
both name the attacker's site), so the Origin check cannot stop it from using the
published demo key. A server on loopback therefore answers only Host names that are its
own (`localhost`, `127.0.0.1`, `[::1]`, and any `--allow-host`); others get 421 (HTTP) or
a refused upgrade (403)."""

from __future__ import annotations

import json

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(header: str) -> str:
    """The name in a Host header, without its port, lowercase ('[::1]:8000' -> '::1')."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostAllowlist:
    def __init__(self, app, hosts: tuple[str, ...]):
        self.app = app
        self.hosts = frozenset(h.strip("[]").lower() for h in hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if host_name(host) not in self.hosts:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})       # before accept: 403
                    return
                body = json.dumps({"error": {"message": f"this server does not answer for host {host[:80]!r}",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "host_not_allowed"}}).encode()
                await send({"type": "http.response.start", "status": 421,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
