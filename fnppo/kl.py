"""KL coefficient controllers, optax-style ``init`` / ``update`` pairs over a :class:`KLControllerState`.
Implementation: :mod:`fnppo.core.losses.kl_control`."""

from __future__ import annotations

from fnppo.core.losses.kl_control import KLControllerState as KLControllerState
from fnppo.core.losses.kl_control import adaptive_kl_init as adaptive_kl_init
from fnppo.core.losses.kl_control import adaptive_kl_update as adaptive_kl_update
from fnppo.core.losses.kl_control import fixed_kl_init as fixed_kl_init
from fnppo.core.losses.kl_control import fixed_kl_update as fixed_kl_update
from fnppo.core.losses.kl_control import with_kl_coef as with_kl_coef

__all__ = [
    "KLControllerState",
    "adaptive_kl_init",
    "adaptive_kl_update",
    "fixed_kl_init",
    "fixed_kl_update",
    "with_kl_coef",
]
