"""Tenants: API keys, quotas, budgets and usage (not built yet; see the gateway issue)."""
