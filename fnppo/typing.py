"""Call-time shape checking and the two error types.
Implementation: :mod:`fnppo.core.typing`, :mod:`fnppo.core.errors`."""

from __future__ import annotations

from fnppo.core.errors import InputError as InputError
from fnppo.core.errors import ShapeError as ShapeError
from fnppo.core.typing import set_typechecking as set_typechecking
from fnppo.core.typing import typechecking as typechecking
from fnppo.core.typing import typechecking_enabled as typechecking_enabled

__all__ = [
    "set_typechecking",
    "typechecking",
    "typechecking_enabled",
    "InputError",
    "ShapeError",
]
