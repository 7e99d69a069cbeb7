# temporary re-export shim (redesign): removed at integration
"""Former home of the policy losses and their registry; they live in :mod:`fnppo.core.losses.policy`.

There is no registry any more: a policy loss is a callable passed as ``LossConfig(policy=...)``.
``get_policy_loss``, ``register_policy_loss`` and ``registered_policy_losses`` remain only as names
that refuse to work (``fnppo/__init__.py`` still imports them until the top-level API is rewritten).
"""

from typing import Any, NoReturn

from fnppo.core.losses.policy import PolicyInputs as PolicyInputs
from fnppo.core.losses.policy import PolicyLoss as PolicyLoss
from fnppo.core.typing import input_error

PolicyLossInputs = PolicyInputs
PolicyLossFn = PolicyLoss


def _removed(name: str) -> NoReturn:
    raise input_error(f"fnppo.{name}", "name", "no call: the policy-loss registry is gone; pass the loss itself, "
                      "LossConfig(policy=my_loss) (flat names: fnppo.losses.from_flat(policy_loss=...))", "a call")


def register_policy_loss(*_: Any, **__: Any) -> NoReturn:
    """Removed (no registry): pass the callable as ``LossConfig(policy=...)``."""
    _removed("register_policy_loss")


def get_policy_loss(*_: Any, **__: Any) -> NoReturn:
    """Removed (no registry): the built-in factories are ``fnppo.core.losses.flat.POLICY_LOSSES``."""
    _removed("get_policy_loss")


def registered_policy_losses(*_: Any, **__: Any) -> NoReturn:
    """Removed (no registry): the built-in names are ``fnppo.core.losses.flat.POLICY_LOSSES``."""
    _removed("registered_policy_losses")
