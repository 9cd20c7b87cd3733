"""Python values as plain JSON: the one conversion every record and summary uses.

Non-finite floats become the strings ``"nan"``, ``"inf"`` and ``"-inf"``:
the files stay strict JSON (``json.dumps(..., allow_nan=False)`` accepts
them, as every JSON reader must), the three values stay distinct (``null``
would merge them), two NaNs compare equal in a settings diff, and
``float(text)`` reads each back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from torch import Tensor

__all__ = ["jsonable"]


def jsonable(value: Any) -> Any:
    """``value`` as nested dicts, lists, strings, ints, finite floats, bools and ``None``.

    Dataclasses become dicts of their fields, mappings dicts with string keys,
    tuples and arrays (numpy or torch) lists, numpy and torch scalars Python
    numbers, non-finite floats their names; anything else (dtypes, devices,
    enums, paths) its ``str``, which is what a person compares.

    Example:
        >>> import json
        >>> record = jsonable({"a": (1, float("nan")), "b": np.float32(-np.inf)})
        >>> json.dumps(record, allow_nan=False)
        '{"a": [1, "nan"], "b": "-inf"}'
        >>> float(jsonable(float("inf")))
        inf
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic, Tensor)):
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
