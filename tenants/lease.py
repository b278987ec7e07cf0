"""One admitted request's hold on its tenant's quotas (`Lease`), and the two ways a quota
backend refuses (see tenants/quota.py for the protocol both backends follow)."""

from __future__ import annotations

import threading
import uuid

from .models import Tenant


class QuotaExceeded(Exception):
    """A limit refused the request; `retry_after` is None when a retry can never succeed."""

    def __init__(self, reason: str, message: str, retry_after: float | None,
                 headers: dict[str, str]):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
        self.headers = headers


class QuotaBackendUnavailable(Exception):
    """The shared quota store cannot be reached: the request is refused (fail closed) and
    may be retried after `retry_after` seconds (503 `quota_backend_unavailable`)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Lease:
    """One admitted request's hold on its tenant's quotas; settle it exactly once.
    `manager` is the backend: `_reserve_more(lease, tokens)`, `_trim(lease, keep)` and
    `_release(lease, used)`."""

    def __init__(self, manager, tenant: Tenant, reserved_tokens: int, lease_id: str | None = None):
        self.id = lease_id or uuid.uuid4().hex  # the Redis backend's settle id
        self.tenant = tenant.name
        self._tenant = tenant
        self.reserved_tokens = reserved_tokens
        self._manager = manager
        self._lock = threading.Lock()
        self._settled = False

    @property
    def settled(self) -> bool:
        return self._settled

    async def reserve_tokens(self, tokens: int) -> None:
        """Make this lease hold `tokens` in all from tokens_per_minute and daily_tokens, or
        raise QuotaExceeded changing nothing (the lease keeps its slot: settle it). What
        `begin` prepaid counts: no wait when it covers `tokens` (the excess goes back)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0 (got {tokens})")
        if self._settled:
            raise RuntimeError("the lease is already settled")
        if tokens > self.reserved_tokens:
            await self._manager._reserve_more(self, tokens - self.reserved_tokens)
        elif tokens < self.reserved_tokens:
            self._manager._trim(self, tokens)

    def settle(self, used_tokens: int) -> bool:
        """Release the lease and bill `used_tokens`; True the first time, then False."""
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0 (got {used_tokens})")
        with self._lock:
            if self._settled:
                return False
            self._settled = True
        self._manager._release(self, used_tokens)
        return True

    def __repr__(self) -> str:
        return f"Lease({self.tenant!r}, reserved_tokens={self.reserved_tokens}, settled={self._settled})"
