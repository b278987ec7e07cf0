"""Structured JSON logs (structlog) with the request id bound through contextvars.

`RequestContext` is pure ASGI middleware, so the contextvars it binds are visible to the
endpoint and everything it awaits (BaseHTTPMiddleware would run the endpoint in another
context). Prompts, completions and API keys are never logged.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid

import structlog


def configure_logging(level: int = logging.INFO, stream=None) -> None:
    """JSON lines on stderr for structlog and stdlib loggers alike (uvicorn, engine)."""
    shared = [structlog.contextvars.merge_contextvars, structlog.stdlib.add_log_level,
              structlog.stdlib.add_logger_name, structlog.processors.TimeStamper(fmt="iso", utc=True)]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "transformers", "urllib3", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class RequestContext:
    """Binds request_id (from X-Request-ID or a fresh one), method and path for the
    request's lifetime, echoes the id in the response and logs one line per request."""

    def __init__(self, app, logger_name: str = "streamgate.http"):
        self.app = app
        self.log = structlog.get_logger(logger_name)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if 0 < len(given) <= 128 and given.isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = None

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id, method=scope.get("method", "WS"),
                                                     path=scope["path"]):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                if scope["type"] == "http" and scope["path"] not in ("/health", "/metrics"):
                    self.log.info("http.request", status=status,
                                  duration_ms=round((time.perf_counter() - start) * 1000, 1))
