"""The split rules: the protocol (:mod:`~fnppo.core.batching.splits.base`) and one module per rule,
each naming its rule class(es) in its ``__all__``. The planner that asks them is
:mod:`fnppo.core.batching.split`.

This package exports every rule of its folder: each module but ``base`` is imported once, when the
package is, in the order of its name, and the names of its ``__all__`` become the package's
(``fnppo.batching`` re-exports them). Nothing is registered or changed after that: a new rule is its
module and its test, no list to edit.
"""

from __future__ import annotations

import importlib
import pkgutil


def _rules() -> tuple[tuple[str, type], ...]:
    """``(name, class)`` of every rule module's ``__all__``, the modules in sorted order."""
    found: dict[str, type] = {}
    for name in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if name == "base" or name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{name}")
        names = getattr(module, "__all__", None)
        if names is None:
            raise ImportError(f"{module.__name__} has no __all__: a split rule module names its rule class(es) there")
        for rule in names:
            if rule in found:
                raise ImportError(f"{module.__name__} exports {rule!r}, which another split rule module exports too")
            found[rule] = getattr(module, rule)
    return tuple(found.items())


_RULES = _rules()  # found once, immutable
globals().update(_RULES)
__all__ = tuple(name for name, _ in _RULES)
