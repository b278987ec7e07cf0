"""Tenants file loading, validation messages and constant-time key authentication."""

from __future__ import annotations

import pytest

from tenants import Limits, Registry, Tenant, TenantConfigError, hash_key, new_key

KEY = "sg-acme-secret"
H = hash_key(KEY)

DESIGN_EXAMPLE = f"""
[tenants.acme]
api_key_sha256 = ["{H}"]
priority = 0            # class; lower is served first
weight = 2.0            # share under contention (fair policy)
requests_per_minute = 600
tokens_per_minute = 200000
max_concurrent = 16
max_tokens = 1024       # per request cap
daily_tokens = 5000000  # persisted across restarts
deadline_ms = 30000     # default and upper bound for a request's deadline
"""


def one(**fields) -> dict:
    body = {"api_key_sha256": [H], **fields}
    return {"tenants": {"acme": body}}


def error(data: dict) -> str:
    with pytest.raises(TenantConfigError) as e:
        Registry.from_dict(data)
    return str(e.value)


def test_loads_the_design_example(tmp_path):
    """The DESIGN.md example loads into a Tenant with every limit set."""
    path = tmp_path / "tenants.toml"
    path.write_text(DESIGN_EXAMPLE)
    reg = Registry.from_file(path)
    assert len(reg) == 1 and [t.name for t in reg] == ["acme"]
    assert reg.tenants["acme"] == Tenant(
        name="acme", key_hashes=(H,), priority=0, weight=2.0,
        limits=Limits(requests_per_minute=600, tokens_per_minute=200000, max_concurrent=16,
                      max_tokens=1024, daily_tokens=5000000, deadline_ms=30000))


def test_defaults_and_single_string_hash():
    """A bare string hash is accepted; omitted settings take their defaults (unlimited)."""
    reg = Registry.from_dict({"tenants": {"a.b-c_1": {"api_key_sha256": H.upper()}}})
    t = reg.tenants["a.b-c_1"]
    assert t.key_hashes == (H,) and t.priority == 0 and t.weight == 1.0 and t.limits == Limits()


def test_missing_file_names_the_path(tmp_path):
    """A missing tenants file is a config error naming the path."""
    path = tmp_path / "nope.toml"
    with pytest.raises(TenantConfigError, match="nope.toml"):
        Registry.from_file(path)


def test_bad_toml_names_the_path(tmp_path):
    """Unparsable TOML is a config error naming the path."""
    path = tmp_path / "bad.toml"
    path.write_text("[tenants.acme\n")
    with pytest.raises(TenantConfigError, match="bad.toml.*invalid TOML"):
        Registry.from_file(path)


def test_file_validation_errors_carry_path_and_field(tmp_path):
    """A validation error from a file names the file, the tenant and the field."""
    path = tmp_path / "t.toml"
    path.write_text(DESIGN_EXAMPLE.replace("weight = 2.0", "weight = -1"))
    with pytest.raises(TenantConfigError) as e:
        Registry.from_file(path)
    assert str(e.value) == f"{path}: tenants.acme.weight: must be > 0 (got -1)"


@pytest.mark.parametrize("fields, where", [
    ({"wieght": 2.0}, "tenants.acme.wieght: unknown key; did you mean 'weight'?"),
    ({"priority": True}, "tenants.acme.priority: must be an integer"),
    ({"priority": 1.5}, "tenants.acme.priority: must be an integer"),
    ({"weight": 0}, "tenants.acme.weight: must be > 0 (got 0)"),
    ({"weight": "2"}, "tenants.acme.weight: must be > 0"),
    ({"weight": float("inf")}, "tenants.acme.weight: must be > 0"),
    ({"max_tokens": 0}, "tenants.acme.max_tokens: must be a positive integer (got 0)"),
    ({"daily_tokens": -5}, "tenants.acme.daily_tokens: must be a positive integer"),
    ({"deadline_ms": 1.5}, "tenants.acme.deadline_ms: must be a positive integer"),
    ({"max_concurrent": True}, "tenants.acme.max_concurrent: must be a positive integer"),
    ({"max_prompt_tokens": "4096"}, "tenants.acme.max_prompt_tokens: must be a positive"),
    ({"requests_per_minute": 0}, "tenants.acme.requests_per_minute: must be a positive"),
    ({"tokens_per_minute": -1}, "tenants.acme.tokens_per_minute: must be a positive"),
])
def test_each_invalid_field_names_tenant_and_field(fields, where):
    """Each invalid setting is rejected with a message naming the tenant and the field."""
    assert error(one(**fields)).startswith(where)


def test_hash_required_and_well_formed():
    """api_key_sha256 is required, non-empty, 64 hex chars each, and never echoed back."""
    assert error({"tenants": {"acme": {}}}).startswith("tenants.acme.api_key_sha256: required")
    assert error(one(api_key_sha256=[])).startswith("tenants.acme.api_key_sha256: must be")
    msg = error(one(api_key_sha256=[H, "sg-raw-key-pasted-by-mistake"]))
    assert msg.startswith("tenants.acme.api_key_sha256[1]: must be 64 hex characters")
    assert "sg-raw-key" not in msg
    assert "api_key_sha256[0]" in error(one(api_key_sha256=["g" * 64]))
    assert "listed twice" in error(one(api_key_sha256=[H, H.upper()]))


def test_no_tenants_and_unknown_top_level_rejected():
    """A file without tenants, or with an unknown top-level key, is rejected."""
    assert "at least one tenant" in error({})
    assert "at least one tenant" in error({"tenants": {}})
    assert error({"tenant": {}, "tenants": one()["tenants"]}).startswith("tenant: unknown")


def test_bad_tenant_name_rejected():
    """Tenant names must match [A-Za-z0-9_.-]+."""
    data = {"tenants": {"ac me": {"api_key_sha256": [H]}}}
    assert error(data).startswith("tenants.ac me: tenant name must match")


def test_nested_table_is_an_unknown_key():
    """An unquoted dotted table ([tenants.a.b]) shows up as an unknown key of tenant a."""
    data = {"tenants": {"a": {"api_key_sha256": [H], "b": {}}}}
    assert error(data).startswith("tenants.a.b: unknown key")


def test_same_hash_in_two_tenants_names_both():
    """One key hash listed for two tenants is an error naming both."""
    data = {"tenants": {"acme": {"api_key_sha256": [H]},
                        "beta": {"api_key_sha256": [hash_key("other"), H]}}}
    msg = error(data)
    assert "tenants.beta.api_key_sha256" in msg and "'acme'" in msg


def test_authenticate_right_wrong_and_missing_key():
    """The right key finds its tenant; a wrong, empty or missing key finds none."""
    reg = Registry.from_dict(one())
    assert reg.authenticate(KEY).name == "acme"
    assert reg.authenticate(KEY + "x") is None
    assert reg.authenticate("") is None
    assert reg.authenticate(None) is None


def test_tenant_with_two_keys_and_two_tenants():
    """Either of a tenant's keys authenticates it; other tenants' keys find theirs."""
    k1, k2, k3 = new_key(), new_key(), new_key()
    reg = Registry.from_dict({"tenants": {
        "acme": {"api_key_sha256": [hash_key(k1), hash_key(k2)]},
        "beta": {"api_key_sha256": hash_key(k3)}}})
    assert reg.authenticate(k1).name == "acme" and reg.authenticate(k2).name == "acme"
    assert reg.authenticate(k3).name == "beta"


def test_authenticate_compares_every_hash(monkeypatch):
    """Authentication compares against every stored hash, even after a match."""
    import tenants.registry as registry
    keys = [new_key() for _ in range(4)]
    reg = Registry.from_dict({"tenants": {
        f"t{i}": {"api_key_sha256": hash_key(k)} for i, k in enumerate(keys)}})
    calls = []
    real = registry.hmac.compare_digest
    monkeypatch.setattr(registry.hmac, "compare_digest", lambda a, b: calls.append(b) or real(a, b))
    assert reg.authenticate(keys[0]).name == "t0"
    assert len(calls) == 4


def test_hash_key_and_new_key():
    """hash_key is the sha256 hex of the UTF-8 key; new keys are prefixed and unique."""
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    a, b = new_key(), new_key()
    assert a.startswith("sg-") and len(a) == 46 and a != b
