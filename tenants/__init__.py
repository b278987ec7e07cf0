"""Tenants: who is asking (registry of hashed API keys) and what they may spend (quotas,
daily budgets in a SQLite ledger). Pure logic with injected clocks; imports neither
`gateway` nor `engine`."""

from .ledger import Ledger
from .models import Limits, Tenant
from .quota import Lease, QuotaBackend, QuotaBackendUnavailable, QuotaExceeded, QuotaManager, admit
from .registry import Registry, TenantConfigError, hash_key, new_key

__all__ = [
    "Limits", "Tenant", "Registry", "TenantConfigError", "hash_key", "new_key",
    "Ledger", "QuotaManager", "QuotaExceeded", "Lease", "QuotaBackend",
    "QuotaBackendUnavailable", "admit",
]
