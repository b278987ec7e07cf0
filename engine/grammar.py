"""A request's output grammar (constrained decoding, issue 27): what the gateway builds from
`response_format` or a forced tool call, and the cheap checks run at admission.

The grammar is compiled by llguidance (engine/grammar_runtime.py) into a matcher that gives a
token bitmask per step. `Grammar.check()` runs in the caller's thread at validation: it
refuses an unknown kind, a spec over MAX_SPEC_BYTES, a schema that is not JSON, and whatever
llguidance's grammar validator (token-independent, bounded by LIMITS) rejects, each with a
ValueError whose message starts with "grammar:". The token-level compile that follows runs
off the engine thread (grammar_runtime.py) with its own time limit.

Torch-free: the gateway imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_SPEC_BYTES = 64 * 1024        # a schema or grammar larger than this is refused outright
# llguidance's parser limits (their defaults are sized for a server; these are tighter where the
# cost of one hostile request would land on every row of a step): grammar symbols, lexer
# states (1-2 kB each), the lexer's build fuel (~50k/ms) and a mask step's fuel (~14k/ms).
LIMIT_ARGS = dict(max_grammar_size=200_000, max_lexer_states=50_000, initial_lexer_fuel=1_000_000,
                  step_lexer_fuel=200_000, step_max_items=50_000, verbose_errors=False)
# JSON output without optional whitespace: a random (or weak) model cannot pad it forever, and
# the output is what `json.dumps(..., separators=(",", ":"))` would write.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    """kind: "json_schema" | "json_object" | "regex" | "lark"; spec: the schema as JSON text,
    the regex or the Lark grammar ("" for json_object)."""

    kind: str
    spec: str = ""

    def check(self) -> None:
        """Raise ValueError("grammar: ...") unless the grammar compiles (token-independent part)."""
        llguidance_grammar(self)

    def __repr__(self) -> str:
        spec = self.spec if len(self.spec) <= 60 else self.spec[:57] + "..."
        return f"Grammar({self.kind!r}, {spec!r})"


def limits():
    import llguidance

    return llguidance.LLParserLimits(**LIMIT_ARGS)


def llguidance_grammar(grammar: Grammar) -> str:
    """The llguidance grammar text for `grammar`, validated; ValueError("grammar: ...") if not."""
    if not isinstance(grammar.kind, str) or grammar.kind not in KINDS:
        raise ValueError(f"grammar: kind must be one of {KINDS} (got {grammar.kind!r})")
    if not isinstance(grammar.spec, str):
        raise ValueError(f"grammar: spec must be a string (got {type(grammar.spec).__name__})")
    size = len(grammar.spec.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise ValueError(f"grammar: the {grammar.kind} is {size} bytes; at most {MAX_SPEC_BYTES} are accepted")
    return _compile_text(grammar.kind, grammar.spec)


@lru_cache(maxsize=256)
def _compile_text(kind: str, spec: str) -> str:
    from llguidance import LLMatcher

    if kind == "json_object":
        text = LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    elif kind == "json_schema":
        try:
            schema = json.loads(spec)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"grammar: the JSON schema is not valid JSON ({exc})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("grammar: a JSON schema must be an object or a boolean")
        try:
            text = LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise ValueError(f"grammar: {exc}") from None
    elif kind == "regex":
        text = LLMatcher.grammar_from_regex(spec)
    else:
        text = LLMatcher.grammar_from_lark(spec)
    error = LLMatcher.validate_grammar(text, None, limits=limits())
    if error:
        raise ValueError(f"grammar: the {kind} does not compile: {error.strip()[:500]}")
    return text
