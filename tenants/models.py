"""Tenant and its limits: frozen values read from the tenants file. `None` means unlimited."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    max_tokens: int | None = None  # per-request cap, also the default when a request gives none
    max_prompt_tokens: int | None = None
    daily_tokens: int | None = None  # persisted across restarts (Ledger)
    deadline_ms: int | None = None  # default and upper bound for a request's deadline


LIMIT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Limits))


@dataclass(frozen=True)
class Tenant:
    name: str
    key_hashes: tuple[str, ...]  # lowercase sha256 hex digests
    priority: int = 0  # class; lower is served first
    weight: float = 1.0  # share under contention (fair policy)
    limits: Limits = Limits()
