"""Tenant isolation: tenant A attacks the server (one attack per process) while tenant B keeps
streaming; `python -m bench.isolation` runs it (run.py)."""
