"""Gateway errors: one class per answer, one table from error to HTTP status and WebSocket
close code.

    GatewayError                    status  code                      WS
    ├── BadRequest                  400     invalid_request_error      error event
    │   └── ContextLengthExceeded   400     context_length_exceeded    error event
    ├── AuthError                   401     invalid_api_key            close 1008
    ├── RateLimited                 429     <the limit: requests_per_minute, ...>  error event
    ├── Overloaded                  503     engine_overloaded          error event
    ├── Draining                    503     server_draining            error event, close 1012
    ├── Unavailable                 503     engine_unavailable         error event
    ├── DeadlineExceeded            504     deadline_exceeded          error event
    └── InternalError               500     internal_error             error event

Every error renders as OpenAI's body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import math

# WebSocket close codes (RFC 6455 and the IANA registry).
WS_POLICY_VIOLATION = 1008
WS_MESSAGE_TOO_BIG = 1009
WS_INTERNAL_ERROR = 1011
WS_SERVICE_RESTART = 1012
WS_TRY_AGAIN_LATER = 1013


class GatewayError(Exception):
    """`retry_after` (seconds) becomes a whole-second Retry-After header and the WebSocket
    error's `retry_after`; None means retrying cannot help (or is not advised)."""

    status = 500
    type = "server_error"
    code = "internal_error"
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


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class AuthError(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class RateLimited(GatewayError):
    """A tenant quota refused the request. `retry_after` is None when retrying cannot help."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, reason: str, retry_after: float | None,
                 headers: dict[str, str] | None = None):
        super().__init__(message, code=reason, headers=headers, retry_after=retry_after)
        self.reason = reason


class Overloaded(GatewayError):
    status = 503
    type = "server_error"
    code = "engine_overloaded"
    default_retry_after = 1.0


class Draining(GatewayError):
    status = 503
    type = "server_error"
    code = "server_draining"
    default_retry_after = 5.0


class Unavailable(GatewayError):
    """The engine thread failed; nothing can be served until a restart."""

    status = 503
    type = "server_error"
    code = "engine_unavailable"


class DeadlineExceeded(GatewayError):
    status = 504
    type = "timeout_error"
    code = "deadline_exceeded"


class InternalError(GatewayError):
    pass
