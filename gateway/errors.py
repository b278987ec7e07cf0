"""Gateway errors: one class per answer. The table from error to HTTP status, error code
and WebSocket close code lives on the classes (`status`, `code`, `ws_close`); `ws.py`
reads close codes from here. `ws_close` is None where a WebSocket answers with an
`error` event and stays open (the error concerns one request, not the connection).

    GatewayError                    status  code                      WS
    ├── BadRequest                  400     invalid_request_error      error event
    │   ├── ContextLengthExceeded   400     context_length_exceeded    error event
    │   ├── PayloadTooLarge         413     request_too_large          close 1009
    │   └── BodyTimeout             408     request_timeout            (HTTP only)
    ├── PolicyViolation             400     policy_violation           close 1008
    ├── AuthError                   401     invalid_api_key            close 1008
    ├── RateLimited                 429     <the limit: requests_per_minute, ...>  error event
    ├── TooManyConnections          429     too_many_connections       close 1013
    ├── Overloaded                  503     engine_overloaded          error event
    ├── Draining                    503     server_draining            error event, close 1012
    ├── Unavailable                 503     engine_unavailable         error event
    ├── QuotaStoreUnavailable       503     quota_backend_unavailable  error event
    ├── DeadlineExceeded            504     deadline_exceeded          error event
    └── InternalError               500     internal_error             error event, close 1011

A socket that times out idle closes with 1000 (a normal closure). Every error renders as
OpenAI's body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import math

# WebSocket close codes (RFC 6455 and the IANA registry).
WS_POLICY_VIOLATION = 1008
WS_MESSAGE_TOO_BIG = 1009
WS_INTERNAL_ERROR = 1011
WS_SERVICE_RESTART = 1012
WS_TRY_AGAIN_LATER = 1013
WS_NORMAL_CLOSURE = 1000


class GatewayError(Exception):
    """`retry_after` (seconds) becomes a whole-second Retry-After header and the WebSocket
    error's `retry_after`; None means retrying cannot help (or is not advised)."""

    status = 500
    type = "server_error"
    code = "internal_error"
    ws_close: int | None = WS_INTERNAL_ERROR
    default_retry_after: float | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})
        self.retry_after = self.default_retry_after if retry_after is None else retry_after
        if self.retry_after is not None:
            self.headers["retry-after"] = str(max(1, math.ceil(self.retry_after)))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request_error"
    ws_close = None


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class PayloadTooLarge(BadRequest):
    """A body or frame over the configured cap; it was not read further."""

    status = 413
    code = "request_too_large"
    ws_close = WS_MESSAGE_TOO_BIG


class BodyTimeout(BadRequest):
    """The client did not send the whole body within the body timeout (slowloris)."""

    status = 408
    code = "request_timeout"


class PolicyViolation(GatewayError):
    """A WebSocket broke the protocol's rules (e.g. did not authenticate in time)."""

    status = 400
    type = "invalid_request_error"
    code = "policy_violation"
    ws_close = WS_POLICY_VIOLATION


class AuthError(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    ws_close = WS_POLICY_VIOLATION


class RateLimited(GatewayError):
    """A tenant quota refused the request. `retry_after` is None when retrying cannot help."""

    status = 429
    type = "rate_limit_error"
    ws_close = None

    def __init__(self, message: str, *, reason: str, retry_after: float | None,
                 headers: dict[str, str] | None = None):
        super().__init__(message, code=reason, headers=headers, retry_after=retry_after)
        self.reason = reason


class TooManyConnections(GatewayError):
    """A connection cap (server-wide, unauthenticated, per tenant, stats subscribers)."""

    status = 429
    type = "rate_limit_error"
    code = "too_many_connections"
    ws_close = WS_TRY_AGAIN_LATER
    default_retry_after = 1.0


class Overloaded(GatewayError):
    status = 503
    type = "server_error"
    code = "engine_overloaded"
    ws_close = None
    default_retry_after = 1.0


class Draining(GatewayError):
    """Per request an error event; for the socket itself, close 1012."""

    status = 503
    type = "server_error"
    code = "server_draining"
    ws_close = WS_SERVICE_RESTART
    default_retry_after = 5.0


class Unavailable(GatewayError):
    """The engine thread failed; nothing can be served until a restart."""

    status = 503
    type = "server_error"
    code = "engine_unavailable"
    ws_close = None


class QuotaStoreUnavailable(GatewayError):
    """The shared quota store (Redis) cannot be reached: admission fails closed; retry."""

    status = 503
    type = "server_error"
    code = "quota_backend_unavailable"
    ws_close = None
    default_retry_after = 1.0


class DeadlineExceeded(GatewayError):
    status = 504
    type = "timeout_error"
    code = "deadline_exceeded"
    ws_close = None


class InternalError(GatewayError):
    pass
