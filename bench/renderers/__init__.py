"""One module per benchmark, each with a `RENDERERS` dict: key "BENCHMARK" or "BENCHMARK MODE"
(the `provenance.benchmark` and `args.mode` of the run's JSON) to a function (data, name) -> the
region's markdown (caption + table). A new benchmark adds a module here; nothing else changes."""

from __future__ import annotations

import importlib
import pkgutil

RENDERERS: dict = {}
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name != "common":
        _module = importlib.import_module(f"{__name__}.{_info.name}")
        for _key, _fn in getattr(_module, "RENDERERS", {}).items():
            if _key in RENDERERS:
                raise RuntimeError(f"two renderers for {_key!r}: {RENDERERS[_key].__module__} and {_module.__name__}")
            RENDERERS[_key] = _fn
