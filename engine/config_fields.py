"""What an EngineConfig section is made of: `knob`, one field with its default, its help text
(the flag's, word for word) and its check; and `Section`, a frozen dataclass that checks its
own knobs at construction. A knob whose default is `None` says what `None` means (`none=`,
"auto: ..." or "off: ..."); its first word is what the command line accepts for it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, NamedTuple


class Check(NamedTuple):
    ok: Callable[[Any], bool]
    says: str                                   # "must be ...", the error's wording


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


POSITIVE_INT = Check(lambda v: _is_int(v) and v > 0, "must be a positive int")
NONNEGATIVE_INT = Check(lambda v: _is_int(v) and v >= 0, "must be an int >= 0")
POSITIVE = Check(lambda v: _is_num(v) and v > 0, "must be > 0")
NONNEGATIVE = Check(lambda v: _is_num(v) and v >= 0, "must be >= 0")


def knob(default: Any, help: str, *, choices: tuple | None = None, check: Check | None = None,
         none: str | None = None) -> Any:
    """A section's field. `help` is the flag's help; `choices` and `check` are what it accepts;
    `none`, for a field that may be None, is what None means ("auto: from the model")."""
    assert default is not None or none is not None, "a knob that defaults to None says what None means"
    return field(default=default, metadata={"help": help, "choices": choices, "check": check, "none": none})


def kind(f: Field) -> type:
    """The field's value type without its `| None` (int, float, str or bool)."""
    name = str(f.type).replace(" | None", "").strip()
    return {"int": int, "float": float, "str": str, "bool": bool}[name]


def none_word(f: Field) -> str | None:
    """What the command line writes for None ("auto", "off", ...), or None if None is not allowed."""
    none = f.metadata["none"]
    return none.split(":", 1)[0].strip() if none else None


@dataclass(frozen=True)
class Section:
    """A frozen group of knobs. Every knob is checked at construction; a bad value raises
    ValueError naming the field as `EngineConfig.<field>`. A subclass checks relations among
    its own fields in `check()`."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None and meta["none"] is not None:
                continue
            maybe = "None or " if meta["none"] is not None else ""
            if kind(f) is bool and not isinstance(value, bool):
                fail(f.name, value, "must be None, True or False" if maybe else "must be a bool")
            if meta["choices"] is not None and value not in meta["choices"]:
                allowed = (None, *meta["choices"]) if maybe else meta["choices"]
                fail(f.name, value, f"must be one of {allowed}")
            if meta["check"] is not None and not meta["check"].ok(value):
                fail(f.name, value, meta["check"].says.replace("must be ", f"must be {maybe}", 1))
        self.check()

    def check(self) -> None:
        """Relations among this section's fields (none by default)."""

    def need(self, ok: bool, name: str, says: str) -> None:
        if not ok:
            fail(name, getattr(self, name), says)


def fail(name: str, value: object, says: str) -> None:
    raise ValueError(f"EngineConfig.{name}: {says} (got {value!r})")
