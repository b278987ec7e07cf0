"""Gateway metrics (per app instance, so tests can run several apps in one process).

`/metrics` serves these together with the engine's own registry.
"""

from __future__ import annotations

import hmac
import ipaddress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .auth import bearer_key

PREFIX = "streamgate_gateway"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "Chat requests by tenant, transport and final status "
                                "(HTTP-style; 499 = the client left or cancelled).",
                                ["tenant", "transport", "status"], registry=self.registry)
        self.limited = Counter(f"{PREFIX}_rate_limited", "Requests refused by a tenant quota, by the limit hit.",
                               ["tenant", "reason"], registry=self.registry)
        self.open_streams = Gauge(f"{PREFIX}_open_streams", "Chat streams in progress.", ["transport"],
                                  registry=self.registry)
        self.websockets = Gauge(f"{PREFIX}_open_websockets", "Open WebSocket connections.", registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Admission to first token, at the gateway.",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
                              registry=self.registry)

    def request_done(self, tenant: str, transport: str, status: int) -> None:
        self.requests.labels(tenant, transport, str(status)).inc()

    def rate_limited(self, tenant: str, reason: str) -> None:
        self.limited.labels(tenant, reason).inc()

    def stream_opened(self, transport: str) -> None:
        self.open_streams.labels(transport).inc()

    def stream_closed(self, transport: str) -> None:
        self.open_streams.labels(transport).dec()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def render(self, *registries: CollectorRegistry) -> bytes:
        return b"".join(generate_latest(r) for r in (*registries, self.registry))


def metrics_allowed(request, token: str | None) -> bool:
    """/metrics names every tenant with its traffic and refusals: with `metrics_token` set,
    only a caller presenting it; without, only a client on this host (loopback)."""
    if token:
        given = bearer_key(request.headers.get("authorization")) or ""
        return hmac.compare_digest(given.encode("utf-8", "replace"), token.encode())
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
