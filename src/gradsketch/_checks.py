"""Argument checks at the library's boundary: one message style, one place.

Each check returns the value it accepted (so ``self.k = positive_int("k", k)``
reads as one step) and otherwise raises with a message that names the
argument in backticks, shows what was received and says how to fix it.
``bool`` is refused where an integer is expected (``True`` is an ``int`` to
Python, never a size to a person).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["check_int", "check_number", "integer", "nonnegative_int", "positive_int"]


def check_int(
    name: str,
    value: Any,
    *,
    low: int | None = None,
    high: int | None = None,
    optional: bool = False,
    fix: str | None = None,
    error: type[Exception] = ValueError,
    type_error: type[Exception] | None = None,
) -> Any:
    """``value`` as an int if it is one (not a bool) in ``[low, high)``; ``None`` if ``optional``.

    numpy integers are accepted and returned as Python ints.

    Args:
        name: the argument's name, shown in backticks.
        value: what was received.
        low: smallest allowed value (``None``: no bound).
        high: first value not allowed (``None``: no bound).
        optional: whether ``None`` is accepted (and returned).
        fix: how to fix it (default: ``pass e.g. name=<low>``).
        error: the exception raised.
        type_error: the exception raised for a value that is not an int
            (default: ``error``).

    Example:
        >>> check_int("rank", 2, low=1)
        2
        >>> check_int("rank", 0, low=1)
        Traceback (most recent call last):
        ...
        ValueError: `rank` must be a positive integer, got 0; pass e.g. rank=1.
        >>> check_int("seed", 2**64, low=0, high=2**64, fix="reduce it modulo 2**64")
        Traceback (most recent call last):
        ...
        ValueError: `seed` must be an integer in [0, 2**64), got 18446744073709551616; reduce it modulo 2**64.
    """  # noqa: E501
    if value is None and optional:
        return None
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if is_int and (low is None or value >= low) and (high is None or value < high):
        return int(value)
    if high is not None:
        wanted = f"an integer in [{low if low is not None else '-inf'}, {_power(high)})"
    elif low == 1:
        wanted = "a positive integer"
    elif low == 0:
        wanted = "a non-negative integer"
    elif low is not None:
        wanted = f"an integer >= {low}"
    else:
        wanted = "an int"
    if optional:
        wanted += " or None"
    got = repr(value) if is_int else f"{value!r} of type {type(value).__name__}"
    if fix is None:
        fix = f"pass e.g. {name}={low if low is not None else 0}"
    raise (error if is_int else type_error or error)(
        f"`{name}` must be {wanted}, got {got}; {fix}."
    )


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    strict: bool = False,
    also: tuple[Any, ...] = (),
    fix: str | None = None,
    error: type[Exception] = ValueError,
) -> Any:
    """``value`` if it is a finite real number (not a bool) ``>= low`` (``> low`` if ``strict``).

    Args:
        name: the argument's name, shown in backticks.
        value: what was received.
        low: the bound (``None``: any finite number).
        strict: whether ``low`` itself is refused.
        also: other values accepted as they are (for example ``"auto"``).
        fix: how to fix it (default: ``pass e.g. name=<low>``).
        error: the exception raised.

    Example:
        >>> check_number("lambda_reg", "auto", low=0, also=("auto",))
        'auto'
        >>> check_number("lr", 0.0, low=0, strict=True, fix="pass e.g. lr=0.01")
        Traceback (most recent call last):
        ...
        ValueError: `lr` must be a finite number > 0, got 0.0; pass e.g. lr=0.01.
    """
    if any(value == allowed and type(value) is type(allowed) for allowed in also):
        return value
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, bool
    )
    if number and math.isfinite(value):
        if low is None or value > low or (value == low and not strict):
            return value
    wanted = "a finite number"
    if low is not None:
        wanted += f" {'>' if strict else '>='} {low}"
    wanted += "".join(f" or {allowed!r}" for allowed in also)
    if fix is None:
        fix = f"pass e.g. {name}={low if low is not None and not strict else 1}"
    raise error(f"`{name}` must be {wanted}, got {value!r}; {fix}.")


def positive_int(name: str, value: Any, **kwargs: Any) -> Any:
    """:func:`check_int` with ``low=1``.

    Example:
        >>> positive_int("proj_dim", 2048)
        2048
        >>> positive_int("proj_dim", True, fix="pass the projection size, e.g. proj_dim=2048")
        Traceback (most recent call last):
        ...
        ValueError: `proj_dim` must be a positive integer, got True of type bool; pass the projection size, e.g. proj_dim=2048.
    """  # noqa: E501
    return check_int(name, value, low=1, **kwargs)


def nonnegative_int(name: str, value: Any, **kwargs: Any) -> Any:
    """:func:`check_int` with ``low=0``.

    Example:
        >>> nonnegative_int("offset", 0)
        0
    """
    return check_int(name, value, low=0, **kwargs)


def integer(name: str, value: Any, **kwargs: Any) -> Any:
    """:func:`check_int` with no bound (seeds); a non-int raises ``TypeError`` by default.

    Example:
        >>> integer("seed", -3)
        -3
        >>> integer("seed", 1.5)
        Traceback (most recent call last):
        ...
        TypeError: `seed` must be an int, got 1.5 of type float; pass e.g. seed=0.
    """
    kwargs.setdefault("type_error", TypeError)
    return check_int(name, value, **kwargs)


def _power(value: int) -> str:
    # Bounds such as 2**64 read better as powers of two.
    if value > 1024 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return str(value)
