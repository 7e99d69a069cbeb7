"""Griffe extension (the API reference): a module whose ``__all__`` is built by code when it is imported
(``fnppo.core.batching.splits``: every rule module of its folder) has the exports Python gives it.

Griffe reads ``__all__`` from the source and cannot evaluate a call; for such a module it records an
empty ``__all__``, so a namespace that star-imports it (``fnppo.batching``) would document none of
its names. For each module whose ``__all__`` it could not read, this imports the module, takes its
``__all__`` and makes each name an alias of the object where it is defined (``ByCount`` ->
``fnppo.core.batching.splits.count.ByCount``), before griffe expands exports and wildcard imports.
"""

from __future__ import annotations

import importlib
from typing import Any

import griffe


class RuntimeExports(griffe.Extension):
    def on_module_members(self, *, mod: griffe.Module, **kwargs: Any) -> None:  # noqa: ARG002 (griffe's signature)
        if mod.exports is None or mod.exports:  # no __all__, or one read from the source
            return
        module = importlib.import_module(mod.path)
        names = list(getattr(module, "__all__", ()))
        for name in names:
            if name not in mod.members:
                obj = getattr(module, name)
                mod.set_member(name, griffe.Alias(name, f"{obj.__module__}.{obj.__qualname__}", parent=mod))
        mod.exports = names
