"""The engine's port (`engine.EngineClient`): AsyncEngine and the tests' fakes declare it and
define every member themselves, with its signature; the gateway uses nothing else."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from engine import EngineClient, EngineConfig
from engine.async_engine import AsyncEngine
from tests.fake_engine import FakeEngine, FloodEngine

GATEWAY = Path(__file__).resolve().parents[1] / "gateway"
METHODS = [n for n, v in vars(EngineClient).items() if inspect.isfunction(v) and not n.startswith("_")]
FIELDS = list(EngineClient.__annotations__)


def _shape(fn) -> list[tuple]:
    """Parameter names, kinds and defaults (annotations aside: the fakes leave them out)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _kind(fn) -> str:
    if inspect.isasyncgenfunction(fn):
        return "async iterator"
    return "coroutine" if inspect.iscoroutinefunction(fn) else "plain"


def test_the_port_names_what_the_issue_asks():
    """start/stop/ready/error/limits/generate/abort/stats, and what the gateway also uses."""
    assert set(METHODS) == {"start", "stop", "validate", "generate", "abort", "stats"}
    assert set(FIELDS) == {"ready", "error", "limits", "tokenizer", "metrics_registry"}


@pytest.mark.parametrize("impl", [AsyncEngine, FakeEngine, FloodEngine], ids=lambda c: c.__name__)
def test_implementations_define_every_member_with_its_signature(impl):
    """Each declares the port and overrides each method with the same parameters (names,
    kinds, defaults) and the same kind of callable; `generate` is an async iterator."""
    assert EngineClient in impl.__mro__          # declared, not merely shaped alike
    for name in METHODS:
        mine, port = getattr(impl, name), getattr(EngineClient, name)
        assert mine is not port, f"{impl.__name__}.{name} is the protocol's stub"
        assert _shape(mine) == _shape(port), f"{impl.__name__}.{name}{inspect.signature(mine)}"
        want = "async iterator" if name == "generate" else _kind(port)
        assert _kind(mine) == want, f"{impl.__name__}.{name} is {_kind(mine)}, not {want}"


@pytest.mark.parametrize("make", [lambda: AsyncEngine(EngineConfig()), FakeEngine, FloodEngine],
                         ids=["AsyncEngine", "FakeEngine", "FloodEngine"])
def test_implementations_have_every_field(make):
    """The port's data members exist on an instance (before start, as the gateway builds it)."""
    engine = make()
    for name in FIELDS:
        assert name in vars(engine) or isinstance(inspect.getattr_static(engine, name), property), name


def test_the_gateway_uses_only_the_port():
    """Every `engine.<member>` the gateway's server modules read is a member of the port
    (cli.py's `chat` command drives the synchronous LLMEngine itself, with no server)."""
    used: dict[str, set[str]] = {}
    for path in sorted(set(GATEWAY.glob("*.py")) - {GATEWAY / "cli.py"}):
        text = path.read_text()
        for match in re.finditer(r"(?<!settings)(?<!config)\.engine\.(\w+)|\bengine\.(\w+)\(", text):
            name = match.group(1) or match.group(2)
            used.setdefault(name, set()).add(path.name)
    allowed = set(METHODS) | set(FIELDS)
    assert {n for n in used if n not in allowed} == set(), used
    assert {"generate", "validate", "abort", "stats", "limits", "tokenizer", "error"} <= set(used)
