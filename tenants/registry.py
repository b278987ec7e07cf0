"""The tenants file (TOML) and API-key authentication.

Keys are stored only as SHA-256 hex digests. `authenticate` hashes the presented key once
and compares it with every stored digest in constant time, without an early exit, so the
time taken does not reveal which tenant (if any) matched.
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import math
import os
import re
import secrets
import tomllib
from collections.abc import Iterator

from .models import LIMIT_FIELDS, Limits, Tenant

NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
HASH_RE = re.compile(r"[0-9a-fA-F]{64}")
KNOWN_KEYS = ("api_key_sha256", "priority", "weight") + LIMIT_FIELDS


class TenantConfigError(ValueError):
    """The tenants file is missing, unparsable or invalid; the message names the field."""


def hash_key(key: str) -> str:
    """SHA-256 hex digest of the UTF-8 key (what the tenants file stores)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random API key."""
    return "sg-" + secrets.token_urlsafe(32)


class Registry:
    """Tenants by name, plus a flat list of (digest, tenant) pairs for authentication."""

    def __init__(self, tenants: dict[str, Tenant]):
        if not tenants:
            raise TenantConfigError("tenants: at least one tenant is required")
        self.tenants: dict[str, Tenant] = dict(tenants)
        self._keys: list[tuple[str, Tenant]] = []
        owner: dict[str, str] = {}
        for tenant in self.tenants.values():
            for digest in tenant.key_hashes:
                if digest in owner:
                    raise TenantConfigError(
                        f"tenants.{tenant.name}.api_key_sha256: the same key hash is also "
                        f"listed for tenant {owner[digest]!r}")
                owner[digest] = tenant.name
                self._keys.append((digest, tenant))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Registry:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise TenantConfigError(f"{path}: tenants file not found") from None
        except OSError as e:
            raise TenantConfigError(f"{path}: cannot read tenants file ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise TenantConfigError(f"{path}: invalid TOML ({e})") from None
        try:
            return cls.from_dict(data)
        except TenantConfigError as e:
            raise TenantConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, data: dict) -> Registry:
        if not isinstance(data, dict):
            raise TenantConfigError("tenants file: expected a table")
        for key in data:
            if key != "tenants":
                raise TenantConfigError(f"{key}: unknown top-level key (expected [tenants.<name>])")
        section = data.get("tenants")
        if not isinstance(section, dict) or not section:
            raise TenantConfigError("tenants: at least one tenant is required ([tenants.<name>])")
        return cls({name: _parse_tenant(name, body) for name, body in section.items()})

    def authenticate(self, key: str | None) -> Tenant | None:
        """The tenant owning `key`, or None; every stored digest is compared (no early exit)."""
        if not key:
            return None
        digest = hash_key(key)
        found: Tenant | None = None
        for stored, tenant in self._keys:
            if hmac.compare_digest(digest, stored):
                found = tenant
        return found

    def __len__(self) -> int:
        return len(self.tenants)

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.tenants.values())


def _parse_tenant(name: str, body: object) -> Tenant:
    where = f"tenants.{name}"
    if not NAME_RE.fullmatch(name):
        raise TenantConfigError(f"{where}: tenant name must match [A-Za-z0-9_.-]+")
    if not isinstance(body, dict):
        raise TenantConfigError(f"{where}: expected a table of settings")
    for key in body:
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TenantConfigError(f"{where}.{key}: unknown key{hint}")
    priority = body.get("priority", 0)
    if not _is_int(priority):
        raise TenantConfigError(f"{where}.priority: must be an integer (got {priority!r})")
    weight = body.get("weight", 1.0)
    if not _is_number(weight) or not math.isfinite(weight) or weight <= 0:
        raise TenantConfigError(f"{where}.weight: must be > 0 (got {weight!r})")
    limits = {}
    for field in LIMIT_FIELDS:
        value = body.get(field)
        if value is not None and (not _is_int(value) or value <= 0):
            raise TenantConfigError(f"{where}.{field}: must be a positive integer (got {value!r})")
        limits[field] = value
    return Tenant(name=name, key_hashes=_parse_hashes(where, body), priority=priority,
                  weight=float(weight), limits=Limits(**limits))


def _parse_hashes(where: str, body: dict) -> tuple[str, ...]:
    field = f"{where}.api_key_sha256"
    if "api_key_sha256" not in body:
        raise TenantConfigError(f"{field}: required (a list of SHA-256 hex digests of the keys)")
    raw = body["api_key_sha256"]
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise TenantConfigError(f"{field}: must be a digest or a non-empty list of digests")
    hashes: list[str] = []
    for i, h in enumerate(raw):
        # Never echo the value: a raw key pasted here by mistake must not reach the logs.
        if not isinstance(h, str) or not HASH_RE.fullmatch(h):
            got = f"{len(h)} characters" if isinstance(h, str) else type(h).__name__
            raise TenantConfigError(
                f"{field}[{i}]: must be 64 hex characters, a SHA-256 digest (got {got})")
        if h.lower() in hashes:
            raise TenantConfigError(f"{field}[{i}]: the same hash is listed twice")
        hashes.append(h.lower())
    return tuple(hashes)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
