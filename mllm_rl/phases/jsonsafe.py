"""Strict JSON for everything a run writes: a non-finite float is the string ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` (a bare NaN is not JSON), so a NaN loss stays visible."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

NON_FINITE = ("NaN", "Infinity", "-Infinity")


def _float_text(x: float) -> str:
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats as their ``NON_FINITE`` names and numpy scalars as Python's."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, numbers.Integral):  # numpy ints
        return int(obj)
    if isinstance(obj, numbers.Real):
        x = float(obj)
        return x if math.isfinite(x) else _float_text(x)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """``json.dumps`` of ``json_safe(obj)``, ``allow_nan=False``; other objects through ``default`` (``str``)."""
    kw.setdefault("default", str)
    return json.dumps(json_safe(obj), allow_nan=False, **kw)


def is_non_finite(v: Any) -> bool:
    """A float that is NaN/inf, or its ``NON_FINITE`` name as written by ``dumps``."""
    if isinstance(v, str):
        return v in NON_FINITE
    return isinstance(v, float) and not math.isfinite(v)
