"""Who is asking: the API key from `Authorization: Bearer …` (or a WebSocket auth message)
resolved to a tenant. Keys are never logged."""

from __future__ import annotations

from tenants import Registry, Tenant

from .errors import AuthError


def bearer_key(authorization: str | None) -> str | None:
    """The key from an `Authorization: Bearer <key>` header, or None."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def authenticate(registry: Registry, key: str | None) -> Tenant:
    if not key:
        raise AuthError("missing API key: send 'Authorization: Bearer <key>' (or an auth message on a WebSocket)")
    if not key.isascii() and not key.isprintable():
        raise AuthError("invalid API key")          # e.g. a lone surrogate: no key has one
    try:
        tenant = registry.authenticate(key)
    except UnicodeEncodeError:
        raise AuthError("invalid API key") from None
    if tenant is None:
        raise AuthError("invalid API key")
    return tenant
