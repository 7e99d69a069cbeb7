"""The built-in policy losses, as one list found in their family modules (no registry; pure Python).

A family module (:mod:`~fnppo.core.losses.policy`, :mod:`~fnppo.core.losses.covariance`,
:mod:`~fnppo.core.losses.offpolicy`) names its losses in its ``__all__``; :data:`BUILTIN_LOSSES` is
those classes, in that order. It is the one list that the flat tables of
:func:`~fnppo.core.losses.flat.from_flat`, the package's exports and the tests read: a new loss in a
family module is its class and its name in that module's ``__all__``, nothing else. (A test checks
that every :class:`~fnppo.core.losses.policy.Builtin` subclass of the package is in it.)
"""

from __future__ import annotations

from fnppo.core.losses import covariance, offpolicy, policy

__all__ = ["FAMILIES", "BUILTIN_LOSSES"]

FAMILIES = (policy, covariance, offpolicy)
"""The modules of the built-in policy losses (a new family module is one entry here and one line of
the package's ``__all__``)."""

BUILTIN_LOSSES: tuple[type, ...] = tuple(getattr(module, name) for module in FAMILIES for name in module.__all__)
"""Every built-in policy loss class, in the order of :data:`FAMILIES` and their ``__all__``."""
