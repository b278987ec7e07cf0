"""Structured JSON logs (structlog) with the request id bound through contextvars.

`RequestContext` is pure ASGI middleware, so the contextvars it binds are visible to the
endpoint and everything it awaits (BaseHTTPMiddleware would run the endpoint in another
context). Prompts, completions and API keys are never logged.
"""

from __future__ import annotations

import asyncio
import itertools
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


class RequestIds:
    """Fresh request ids: a random per-process prefix and a counter, unique without a
    system call per request (uuid4 reads os.urandom each time)."""

    def __init__(self) -> None:
        self.prefix = uuid.uuid4().hex[:16]
        self.count = itertools.count(1)

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.count):016x}"


class RefusalLog:
    """429 answers (a cap or quota refused the request) are counted per path and logged
    as one `http.refused` line per path at most every `every_s` seconds, with the count:
    a flood of refused requests must not also flood the log (a line costs ~0.2 ms of the
    event loop and a write)."""

    def __init__(self, log, every_s: float = 1.0):
        self.log, self.every_s = log, every_s
        self.counts: dict[str, int] = {}       # path -> refusals not yet logged
        self.timers: dict[str, asyncio.TimerHandle] = {}

    def add(self, path: str) -> None:
        """Count one refusal (on the event loop): the first of a quiet path is logged at
        once, the rest when its timer fires."""
        self.counts[path] = self.counts.get(path, 0) + 1
        if path not in self.timers:
            self._flush(path)

    def _flush(self, path: str) -> None:
        count = self.counts.pop(path, 0)
        if count:
            self.log.info("http.refused", status=429, path=path, count=count)
            self.timers[path] = asyncio.get_running_loop().call_later(self.every_s, self._flush, path)
        else:
            self.timers.pop(path, None)


class RequestContext:
    """Binds request_id (from X-Request-ID or a fresh one), method and path for the
    request's lifetime, echoes the id in the response and logs one line per request
    (refusals with 429: see RefusalLog)."""

    def __init__(self, app, logger_name: str = "streamgate.http"):
        self.app = app
        self.log = structlog.get_logger(logger_name)
        self.refusals = RefusalLog(self.log)
        self.new_id = RequestIds()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if 0 < len(given) <= 128 and given.isprintable() else self.new_id()
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
                if scope["type"] != "http" or scope["path"] in ("/health", "/metrics"):
                    pass
                elif status == 429:
                    self.refusals.add(scope["path"])
                else:
                    self.log.info("http.request", status=status,
                                  duration_ms=round((time.perf_counter() - start) * 1000, 1))
