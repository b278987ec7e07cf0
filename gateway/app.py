"""The Starlette app: `create_app(settings)` wires tenants, quotas, the engine and the routes.

The engine loads in the background during the lifespan, so `/health` answers 503
("loading") at once and 200 when the model is ready. `Gateway.drain()` (called on
SIGTERM by `serve`, see gateway/server.py) refuses new work, lets streams finish for a
grace period and aborts the rest with a final `server_draining` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from engine import EngineConfig
from tenants import Ledger, QuotaManager, Registry

from .auth import authenticate, bearer_key
from .chat import ChatService
from .errors import GatewayError, InternalError
from .live import snapshot
from .logs import RequestContext
from .metrics import GatewayMetrics
from .sse import chat_completions, error_response, list_models
from .ws import chat_socket

log = structlog.get_logger("streamgate.app")

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

# The gateway drains SSE streams itself (Gateway.drain); sse-starlette must not cut them
# the moment uvicorn sees SIGTERM.
AppStatus.disable_automatic_graceful_drain()


def default_ledger_path() -> str:
    root = os.environ.get("STREAMGATE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "streamgate")
    return os.path.join(root, "usage.sqlite3")


@dataclass(frozen=True)
class GatewaySettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    tenants_file: str | None = None
    ledger_path: str | None = None          # None: ~/.cache/streamgate/usage.sqlite3
    model_name: str | None = None           # the name /v1/models reports; None: from engine.model
    allowed_origins: tuple[str, ...] = ()   # browser Origins allowed on the WebSocket; (): same host only
    max_frame_bytes: int = 1 << 20
    max_sockets: int = 1024
    max_requests_per_socket: int = 32
    drain_grace_s: float = 30.0
    keepalive_s: float = 15.0
    default_max_tokens: int = 1024          # when neither the request nor the tenant sets one


class Gateway:
    """Everything the routes share, on `app.state.gateway`."""

    def __init__(self, settings: GatewaySettings, *, engine=None, registry: Registry | None = None,
                 quotas: QuotaManager | None = None):
        from engine import AsyncEngine

        self.settings = settings
        self.registry = registry or Registry.from_file(settings.tenants_file)
        self.ledger = None
        if quotas is None:
            self.ledger = Ledger(settings.ledger_path or default_ledger_path())
            quotas = QuotaManager(self.ledger)
        self.quotas = quotas
        self.engine = engine or AsyncEngine(settings.engine)
        self.metrics = GatewayMetrics()
        name = settings.model_name or ("SmolLM2-135M-Instruct" if settings.engine.model == "default"
                                       else Path(settings.engine.model).name or settings.engine.model)
        self.chat = ChatService(self.engine, self.quotas, self.metrics, model_name=name,
                                default_max_tokens=settings.default_max_tokens)
        self.started_at = int(time.time())
        self.open_sockets = 0
        self.drain_started = asyncio.Event()
        self.load_error: BaseException | None = None

    def authenticate(self, key: str | None):
        return authenticate(self.registry, key)

    async def load(self) -> None:
        try:
            if self.engine.engine is None or not getattr(self.engine, "_running", False):
                await self.engine.start()
            self.chat.on_engine_started()
            log.info("engine.ready", model=self.chat.model_name, max_model_len=self.chat.max_model_len)
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
        await self.engine.stop()
        if self.ledger is not None:
            self.ledger.close()


async def health(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    if gw.load_error is not None:
        return JSONResponse({"status": "error", "detail": f"model failed to load: {gw.load_error}"}, 503)
    if gw.engine.error is not None:
        return JSONResponse({"status": "error", "detail": f"the engine failed: {gw.engine.error!r}"}, 503)
    if gw.chat.draining:
        return JSONResponse({"status": "draining"}, 503)
    if not gw.chat.ready:
        return JSONResponse({"status": "loading"}, 503)
    return JSONResponse({"status": "ok", "model": gw.chat.model_name})


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    engine = gw.engine.engine
    registries = [engine.metrics.registry] if gw.chat.ready else []
    return Response(gw.metrics.render(*registries), media_type="text/plain; version=0.0.4; charset=utf-8")


async def stats_stream(request: Request) -> Response:
    """`GET /v1/stats`: the live scheduler view as SSE (aggregate numbers only)."""
    gw: Gateway = request.app.state.gateway
    gw.authenticate(bearer_key(request.headers.get("authorization")))
    try:
        interval = min(10.0, max(0.1, float(request.query_params.get("interval_ms", 500)) / 1000))
    except ValueError:
        interval = 0.5

    async def events():
        while not gw.chat.draining:
            yield json.dumps(snapshot(gw, interval))
            await asyncio.sleep(interval)

    return EventSourceResponse(events(), sep="\n", ping=gw.settings.keepalive_s)


async def _gateway_error(request: Request, exc: GatewayError) -> Response:
    return error_response(exc)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.error("http.unhandled", exc_info=exc)
    return error_response(InternalError("internal server error; the request id is in the x-request-id header"))


def create_app(settings: GatewaySettings, *, engine=None, registry: Registry | None = None,
               quotas: QuotaManager | None = None) -> Starlette:
    gw = Gateway(settings, engine=engine, registry=registry, quotas=quotas)

    @contextlib.asynccontextmanager
    async def lifespan(app):
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
        Route("/v1/stats", stats_stream),
        WebSocketRoute("/v1/chat/ws", chat_socket),
    ]
    if (STATIC_DIR / "index.html").exists():
        routes.append(Mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static"))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={GatewayError: _gateway_error,
                                                                           Exception: _unexpected_error})
    app.state.gateway = gw
    app.add_middleware(RequestContext)
    return app
