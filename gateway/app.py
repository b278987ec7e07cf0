"""The Starlette app: `create_app(settings)` wires tenants, quotas, the engine and the routes.

The engine loads in the background during the lifespan, so `/health` answers 503
("loading") at once and 200 when the model is ready. `Gateway.drain()` (called on
SIGTERM by `serve`, see gateway/server.py) refuses new work, lets streams finish for a
grace period and aborts the rest with a final `server_draining` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from engine import EngineClient, EngineConfig, EngineStats
from tenants import Ledger, QuotaBackend, QuotaManager, Registry

from .auth import authenticate, bearer_key
from .chat_api import tool_parser
from .completions import completions
from .deadline import WriteDeadline
from .errors import GatewayError, InternalError, TooManyConnections
from .holds import Holds
from .hosts import HostAllowlist
from .limits import Slots
from .live import StatsHub, interval_class
from .logs import RequestContext
from .metrics import GatewayMetrics, metrics_allowed
from .responses import responses
from .server import freeze_heap
from .sse import ClosingEventStream, chat_completions, error_response, list_models
from .streaming import ChatService
from .vllm_metrics import register_vllm_metrics
from .ws import chat_socket

log = structlog.get_logger("streamgate.app")

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

# The gateway drains SSE streams itself (Gateway.drain); sse-starlette must not cut them
# the moment uvicorn sees SIGTERM.
AppStatus.disable_automatic_graceful_drain()


def default_ledger_path(name: str = "usage.sqlite3") -> str:
    root = os.environ.get("STREAMGATE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "streamgate")
    return os.path.join(root, name)


def quota_backend(settings: GatewaySettings) -> tuple[QuotaBackend, Ledger | None]:
    """The embedded backend (in-memory buckets + SQLite ledger) or, with `redis_url`, the
    Redis one; with Redis, `ledger_path` holds the settlements not yet in Redis (outbox)."""
    if settings.redis_url:
        from tenants.redis_quota import RedisQuotas

        outbox = settings.ledger_path or default_ledger_path("quota-outbox.sqlite3")
        return RedisQuotas(settings.redis_url, outbox, lease_ttl=settings.redis_lease_ttl_s), None
    ledger = Ledger(settings.ledger_path or default_ledger_path())
    return QuotaManager(ledger), ledger


@dataclass(frozen=True)
class GatewaySettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    tenants_file: str | None = None
    ledger_path: str | None = None          # None: ~/.cache/streamgate/usage.sqlite3 (quota-outbox.sqlite3 with Redis)
    redis_url: str | None = None            # quotas shared by replicas in Redis; None: embedded
    redis_lease_ttl_s: float = 10.0         # a dead replica's leases are freed within this
    model_name: str | None = None           # the name /v1/models reports; None: from engine.model
    allowed_origins: tuple[str, ...] = ()   # browser Origins allowed on the WebSocket; (): same host only
    max_frame_bytes: int = 1 << 20
    max_body_bytes: int = 1 << 20           # HTTP request bodies; larger ones get 413 unread
    body_timeout_s: float = 30.0            # to send a whole request body; slower ones get 408
    max_json_values: int = 100_000          # commas + brackets in a body or frame (bounds decoding time)
    max_sockets: int = 1024                 # authenticated WebSockets, all tenants
    max_unauthenticated_sockets: int = 64   # sockets that have not authenticated yet (their own pool)
    max_unauthenticated_sockets_per_address: int = 16   # of those, from one client address (429 before the upgrade)
    max_sockets_per_tenant: int = 64
    max_requests_per_socket: int = 32
    max_stats_streams_per_tenant: int = 4   # GET /v1/stats streams + WebSocket subscriptions
    ws_auth_timeout_s: float = 5.0          # a socket must authenticate within this or is closed 1008
    ws_idle_timeout_s: float = 300.0        # no frame and nothing running for this long: closed 1000
    ws_preauth_max_frame_bytes: int = 4096  # a frame before auth (auth, ping) past this: closed 1009
    ws_preauth_frame_rate: float = 10.0     # frames per second a socket may send before auth (1008 past it) ...
    ws_preauth_frame_burst: int = 20        # ... and at once
    write_timeout_s: float = 30.0           # a send to a client blocked this long aborts the connection
    tokenize_workers: int = 2               # threads rendering chat templates and tokenizing
    drain_grace_s: float = 30.0
    keepalive_s: float = 15.0
    default_max_tokens: int = 1024          # when neither the request nor the tenant sets one
    tool_parser: str | None = None          # hermes | llama3_json | mistral | harmony; None: from the chat template
    metrics_token: str | None = None        # /metrics for callers presenting it; None: loopback clients only
    allowed_hosts: tuple[str, ...] = ()     # Host names answered (DNS rebinding); (): any (serve sets loopback's)
    freeze_gc: bool = False                 # once loaded, start-up's objects leave the GC's scans (serve sets it)


class Gateway:
    """Everything the routes share, on `app.state.gateway`."""

    def __init__(self, settings: GatewaySettings, *, engine: EngineClient | None = None,
                 registry: Registry | None = None,
                 quotas: QuotaBackend | None = None):
        from engine import AsyncEngine

        self.settings = settings
        self.registry = registry or Registry.from_file(settings.tenants_file)
        self.ledger = None
        if quotas is None:
            quotas, self.ledger = quota_backend(settings)
        self.quotas = quotas
        self.engine: EngineClient = engine or AsyncEngine(settings.engine)
        self.metrics = GatewayMetrics()
        name = settings.model_name or ("SmolLM2-135M-Instruct" if settings.engine.model == "default"
                                       else Path(settings.engine.model).name or settings.engine.model)
        self.chat = ChatService(self.engine, self.quotas, self.metrics, model_name=name,
                                default_max_tokens=settings.default_max_tokens,
                                tokenize_workers=settings.tokenize_workers)
        self.scraped: EngineStats | None = None     # the engine's snapshot for the scrape being rendered
        register_vllm_metrics(self.metrics.registry, lambda: self.scraped, name)
        self.started_at = int(time.time())
        self.sockets = Slots()              # authenticated WebSockets: ws.AUTHENTICATED and tenant:<name>
        self.pending_sockets: dict = {}     # ws.Connection -> None, not yet authenticated, oldest first
        self.pending_by_address = Slots()   # the same sockets, counted per client address
        self.stats_slots = Slots()          # stats streams per tenant
        self.stats = StatsHub(self)
        self.drain_started = asyncio.Event()
        self.load_error: BaseException | None = None

    def held(self) -> dict:
        """Everything requests and sockets hold, by registry; each value is empty or 0
        when the gateway is idle (tests assert it after every gateway test: tests/idle.py).
        Call on the event loop."""
        def values(gauge) -> dict:
            return {s.labels.get("transport", ""): s.value for m in gauge.collect() for s in m.samples if s.value}
        return {"chat.active": len(self.chat.active), "stats.subscribers": len(self.stats.subscribers),
                "stats_slots": dict(self.stats_slots.counts), "sockets": dict(self.sockets.counts),
                "pending_sockets": len(self.pending_sockets),
                "pending_by_address": dict(self.pending_by_address.counts),
                "quota.in_flight": {t: n for t in self.registry.tenants if (n := self.quotas.in_flight(t))},
                "open_streams": values(self.metrics.open_streams),
                "open_websockets": sum(values(self.metrics.websockets).values()),
                "billing.unwritten": getattr(getattr(self.quotas, "billing", None), "unwritten", 0)}

    def unauthenticated_full(self, address: str) -> bool:
        """Whether `address` holds its share of the sockets still authenticating (checked
        by the HTTP protocol before a keyless upgrade: gateway/protocols.py)."""
        return self.pending_by_address[address] >= self.settings.max_unauthenticated_sockets_per_address

    def known_key(self, authorization: bytes) -> str | None:
        """The tenant whose valid key an Authorization header carries, or None (a SHA-256
        and a lookup: cheap enough to run in the HTTP protocol before an upgrade)."""
        try:
            tenant = self.registry.authenticate(bearer_key(authorization.decode("latin-1")))
        except UnicodeEncodeError:
            return None
        return None if tenant is None else tenant.name

    def tenant_sockets_full(self, tenant: str) -> bool:
        """Whether `tenant` holds all its WebSocket places (checked before an upgrade)."""
        return self.sockets[f"tenant:{tenant}"] >= self.settings.max_sockets_per_tenant

    def authenticate(self, key: str | None):
        return authenticate(self.registry, key)

    async def load(self) -> None:
        try:
            if not self.engine.ready:
                await self.engine.start()
            await asyncio.to_thread(self.chat.on_engine_started)
            self.chat.admitter.keep_special_tokens = tool_parser(self) == "harmony"
            frozen = freeze_heap() if self.settings.freeze_gc else 0
            self.chat.ready = True
            log.info("engine.ready", model=self.chat.model_name, max_model_len=self.chat.max_model_len, gc_frozen=frozen)
        except Exception as exc:
            self.load_error = exc
            log.exception("engine.load_failed")

    async def drain(self, grace_s: float | None = None) -> None:
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        log.info("drain.start", grace_s=grace, streams=len(self.chat.active))
        self.drain_started.set()
        await self.chat.drain(grace)
        log.info("drain.done")

    async def close(self) -> None:
        self.stats.close()
        self.chat.close()
        await self.engine.stop()
        await self.quotas.stop()        # after the last settlement; Redis: flushes the outbox
        if self.ledger is not None:
            self.ledger.close()


async def health(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    # The exception's text stays in the server's log (engine.load_failed, the engine's own):
    # /health answers anyone, and a message can carry paths or input.
    if gw.load_error is not None:
        return JSONResponse({"status": "error", "detail": "the model failed to load; see the server log"}, 503)
    if gw.engine.error is not None:
        return JSONResponse({"status": "error", "detail": "the engine failed; see the server log"}, 503)
    if gw.chat.draining:
        return JSONResponse({"status": "draining"}, 503)
    if not gw.chat.ready:
        return JSONResponse({"status": "loading"}, 503)
    return JSONResponse({"status": "ok", "model": gw.chat.model_name})


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    if not metrics_allowed(request, gw.settings.metrics_token):
        return JSONResponse({"error": {"message": "metrics need the metrics token (Authorization: Bearer ...) "
                                                  "or a client on this host", "type": "authentication_error",
                                       "param": None, "code": "metrics_forbidden"}}, 403)
    registries, gw.scraped = [], None
    if gw.chat.ready:               # the engine builds a snapshot for this scrape (after its current step)
        registries, gw.scraped = [gw.engine.metrics_registry], await gw.engine.stats()
    return Response(gw.metrics.render(*registries), media_type="text/plain; version=0.0.4; charset=utf-8")


async def stats_stream(request: Request) -> Response:
    """`GET /v1/stats`: the live scheduler view as SSE (aggregate numbers only). Each stream
    holds one of its tenant's `max_stats_streams_per_tenant` places."""
    gw: Gateway = request.app.state.gateway
    tenant = gw.authenticate(bearer_key(request.headers.get("authorization")))
    try:
        interval_ms = float(request.query_params.get("interval_ms", 500))
    except ValueError:
        interval_ms = 500.0
    cap = gw.settings.max_stats_streams_per_tenant
    if not gw.stats_slots.take(tenant.name, cap):
        raise TooManyConnections(f"tenant {tenant.name!r} has {cap} stats streams open; close one first")
    holds = Holds()         # released by the response whatever happens (HEAD: the body never starts)
    holds.take(lambda: gw.stats_slots.give(tenant.name))
    sub = gw.stats.subscribe(interval_class(interval_ms))
    holds.take(lambda: gw.stats.unsubscribe(sub))

    async def events():
        while not gw.chat.draining:
            yield await sub.next()

    return ClosingEventStream(holds.release, events(), sep="\n", ping=gw.settings.keepalive_s)


async def _gateway_error(request: Request, exc: GatewayError) -> Response:
    return error_response(exc)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.error("http.unhandled", exc_info=exc)
    return error_response(InternalError("internal server error; the request id is in the x-request-id header"))


def create_app(settings: GatewaySettings, *, engine: EngineClient | None = None, registry: Registry | None = None,
               quotas: QuotaBackend | None = None) -> Starlette:
    gw = Gateway(settings, engine=engine, registry=registry, quotas=quotas)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await gw.quotas.start()
        loading = asyncio.ensure_future(gw.load())
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
            with contextlib.suppress(BaseException):
                await loading
            await gw.close()

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", list_models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/stats", stats_stream),
        WebSocketRoute("/v1/chat/ws", chat_socket),
    ]
    if (STATIC_DIR / "index.html").exists():
        routes.append(Mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static"))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={GatewayError: _gateway_error,
                                                                           Exception: _unexpected_error})
    app.state.gateway = gw
    app.add_middleware(WriteDeadline, timeout_s=settings.write_timeout_s)
    app.add_middleware(RequestContext)
    if settings.allowed_hosts:
        app.add_middleware(HostAllowlist, hosts=settings.allowed_hosts)
    return app
