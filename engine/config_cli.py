"""The engine's command-line flags, generated from EngineConfig's fields: `streamgate serve`,
`streamgate chat` and the benchmarks all call `add_engine_args`, so a flag's name, default,
choices and help are the field's and cannot drift. `--field-name` for every field, grouped by
section in `--help`; a bool is `--name` / `--no-name`; a field whose default is None takes the
word its `none=` names ("auto", "off", "none") for None."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable
from dataclasses import Field, fields

from .config import SECTIONS, EngineConfig
from .config_fields import kind, none_word

log = logging.getLogger("streamgate")

SAME = object()     # a renamed flag that takes the new flag's value

# Old spellings, kept for one release: each use logs a deprecation line. old flag: (field,
# SAME | the value it sets | {old value: new value}). An old flag that is also the field's
# new flag (--isolate-prompts on/off) lists the values only the old spelling took.
DEPRECATED: dict[str, tuple[str, object]] = {
    "--tp-timeout": ("tp_timeout_s", SAME),
    "--no-prefix-caching": ("enable_prefix_caching", False),
    "--preempt-at-admission": ("preempt_for_priority", {"auto": None, "on": True, "off": False}),
    "--isolate-prompts": ("isolate_prompts", {"on": True, "off": False}),
    "--itl-target-ms": ("itl_target_ms", {"0": None, "0.0": None}),
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, *, only: Iterable[str] | None = None,
                    defaults: dict[str, object] | None = None) -> None:
    """One argument group per EngineConfig section, one flag per field (`only`: these fields;
    `defaults`: a caller's own defaults for some, e.g. a benchmark's model)."""
    wanted = None if only is None else set(only)
    defaults = defaults or {}
    known = {f.name for _, f in EngineConfig.knobs()}
    assert wanted is None or wanted <= known, f"not EngineConfig fields: {wanted - known}"
    assert set(defaults) <= known, f"not EngineConfig fields: {set(defaults) - known}"
    for attr, cls in SECTIONS.items():
        title, _, about = (cls.__doc__ or attr).partition(":")
        group = None
        for f in fields(cls):
            if wanted is not None and f.name not in wanted:
                continue
            group = group or parser.add_argument_group(f"engine: {title.strip()}", about.strip() or None)
            _add_flag(group, f, defaults.get(f.name, f.default))
    old = [o for o, (name, _) in DEPRECATED.items() if (wanted is None or name in wanted) and o != flag(name)]
    if old:
        group = parser.add_argument_group("deprecated engine flags", "old spellings, removed in the next release")
        for o in old:
            name, how = DEPRECATED[o]
            group.add_argument(o, dest=name, action=_Deprecated, how=how, field=_field(name),
                               help=f"use {flag(name)}" + (" / --no-" + flag(name)[2:] if how is not SAME else ""))


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """The EngineConfig the `add_engine_args` flags in `args` describe (fields without a flag
    there keep their defaults; `overrides` win)."""
    given = {f.name: getattr(args, f.name) for _, f in EngineConfig.knobs() if hasattr(args, f.name)}
    return EngineConfig(**{**given, **overrides})


def _add_flag(group, f: Field, default: object) -> None:
    meta, word, legacy = f.metadata, none_word(f), _legacy_values(f.name)
    shown = meta["none"] if default is None else ("on" if default is True else "off" if default is False else default)
    help = f"{meta['help']} (default: {shown})".replace("%", "%%")
    if kind(f) is bool:
        if legacy:
            help += f" ({flag(f.name)} {'/'.join(legacy)}: the old spelling, deprecated)"
        group.add_argument(flag(f.name), dest=f.name, action=_Bool, default=default, legacy=legacy, help=help,
                           metavar="/".join(legacy) if legacy else None)
        return
    choices = meta["choices"]
    metavar = {int: "INT", float: "FLOAT"}.get(kind(f), f.name.upper())
    extra = {"choices": (*choices, None), "metavar": "{" + ",".join((*choices, word)) + "}"} if choices and word \
        else {"choices": choices} if choices \
        else {"metavar": f"{metavar}|{word}" if word else metavar}
    group.add_argument(flag(f.name), dest=f.name, type=_converter(f, legacy), default=default, help=help, **extra)


def _converter(f: Field, legacy: dict | None) -> Callable[[str], object]:
    word, to = none_word(f), kind(f)

    def convert(text: str) -> object:
        if legacy and text in legacy:
            _warn(f"{flag(f.name)} {text}", f"{flag(f.name)} {none_word(f) or ''}".strip())
            return legacy[text]
        return None if word is not None and text == word else to(text)

    convert.__name__ = to.__name__           # argparse says "invalid int value: 'x'"
    return convert


class _Bool(argparse.Action):
    """`--name` sets True, `--no-name` False; with legacy values, `--name VALUE` too (deprecated)."""

    def __init__(self, option_strings, dest, legacy=None, **kw):
        self.legacy = legacy
        super().__init__([*option_strings, "--no-" + option_strings[0][2:]], dest,
                         nargs="?" if legacy else 0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if values not in (None, []):
            if values not in self.legacy:
                parser.error(f"argument {option_string}: takes no value (got {values!r})")
            new = ("" if self.legacy[values] else "--no-" + option_string[2:]) or option_string
            _warn(f"{option_string} {values}", new)
            setattr(namespace, self.dest, self.legacy[values])
            return
        setattr(namespace, self.dest, not option_string.startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class _Deprecated(argparse.Action):
    """An old flag: sets its field as the new flag would, and logs a deprecation line."""

    def __init__(self, option_strings, dest, how=None, field=None, **kw):
        self.how, self.field = how, field
        if how is SAME:
            kw["type"] = _converter(field, None)
        elif isinstance(how, dict):
            kw["choices"] = list(how)
        else:
            kw["nargs"] = 0                                  # a flag without a value: sets `how`
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        name = flag(self.field.name)
        if self.how is SAME:
            value, old, new = values, option_string, name
        else:
            value = self.how[values] if isinstance(self.how, dict) else self.how
            old = f"{option_string} {values}" if isinstance(self.how, dict) else option_string
            new = name if value is True else "--no-" + name[2:] if value is False \
                else f"no flag ({name}'s default is {self.field.metadata['none']})"
        _warn(old, new)
        setattr(namespace, self.dest, value)


def _warn(old: str, new: str) -> None:
    log.warning("deprecated flag %s (removed in the next release): use %s", old, new)


def _legacy_values(name: str) -> dict | None:
    entry = DEPRECATED.get(flag(name))
    return entry[1] if entry and entry[0] == name and isinstance(entry[1], dict) else None


def _field(name: str) -> Field:
    return next(f for _, f in EngineConfig.knobs() if f.name == name)
