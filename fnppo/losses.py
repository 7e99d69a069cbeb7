"""The losses, built from parts: ``fnppo.losses.LossConfig(policy=fnppo.losses.cispo(...), kl=...)``.

A policy loss is any function of :class:`PolicyInputs` returning ``(per-token loss, metrics)``; the
built-in ones are small frozen parts with their own parameters. ``from_flat`` maps flat (verl-style)
settings to parts. Implementation: :mod:`fnppo.core.losses` and :mod:`fnppo.core.losses.rollout_correction`."""

from __future__ import annotations

from fnppo.core import losses as _core
from fnppo.core.losses import *  # noqa: F403 - the public names are fnppo.core.losses.__all__

__all__ = [*_core.__all__]
