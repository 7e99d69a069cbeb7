"""The message check shared by the error tests: function, argument, expected and received.

Every fnppo error reads ``<function>: argument '<argument>' expected <what>, received <what>``
(``docs/errors.md``); a test of an error checks all four parts, not one word of the message.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest

from fnppo.core.errors import InputError, ShapeError


def check_message(err: BaseException, exc: type, fn: str, arg: str, expected: str, received: str) -> None:
    """``err`` is an ``exc`` naming ``fn``, ``arg``, the expectation and the received value.

    InputError / ValueError / TypeError: ``"<fn>: argument '<arg>' expected <expected...>, received
    <received...>"`` (``fn`` may carry a ``fnppo.`` or ``fnppo.<module>.`` prefix; ``expected`` and
    ``received`` are excerpts). ShapeError (call-time type check), all on the first line:
    ``"<module.fn>: argument '<arg>' has <what differs> ...; expected <expected>, received <received>"``.
    """
    msg = str(err)
    assert isinstance(err, exc), f"{type(err).__name__} instead of {exc.__name__}: {msg[:500]}"
    if exc is ShapeError:
        first = msg.split("\n", 1)[0]
        assert msg.startswith("fnppo.") and f".{fn}: argument '{arg}' " in first, msg[:300]
        assert expected in first.rpartition(" expected ")[2], msg[:500]
        assert first.endswith(f"received {received}"), msg[:500]
    else:
        head = rf"^(fnppo\.(\w+\.)*)?{re.escape(fn)}: argument '{re.escape(arg)}' expected "
        assert re.match(head, msg), msg[:500]
        exp_part, _, rec_part = msg.partition(", received ")
        assert expected in exp_part, f"{expected!r} not in {exp_part!r}"
        assert rec_part and received in rec_part, f"{received!r} not in {rec_part!r}"


@contextlib.contextmanager
def raises_message(fn: str, arg: str, expected: str, received: str, exc: type = InputError) -> Iterator[None]:
    """``with raises_message(fn, arg, expected, received): call()``: the call raises ``exc`` with that message."""
    with pytest.raises(exc) as info:
        yield
    check_message(info.value, exc, fn, arg, expected, received)


def messages_of(calls: dict) -> dict:
    """Run each call (one that should raise) and return its outcome by name: an InputError's message,
    ``"no error"``, or ``"<type>: <message>"`` for any other exception (for the assertions to report,
    e.g. from inside a rank function, where raising would hide the other cases)."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except InputError as err:
            out[name] = str(err)
        except Exception as err:  # noqa: BLE001 - reported by the caller's assertions
            out[name] = f"{type(err).__name__}: {err}"
    return out
