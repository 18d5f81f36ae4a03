"""One check of a setting's value, the same for a flag, a tasks-file key and a memplan flag.

``check_value(opt, value, name)`` returns the value (an int accepted where a float is declared)
or raises ``ValueError`` with one line that starts with ``name`` -- the flag (``--lr``) or the
file's key (``lr``): ``--lr must be >= 0, got nan``, ``steps: expected int, got '3'``.
"""

from __future__ import annotations

import math
from typing import Any

from mllm_rl.options.schema import Option

_TYPE_NAMES = {bool: "true/false", int: "int", float: "float", str: "string", list: "list of strings"}


def check_type(opt: Option, value: Any, name: str) -> Any:
    """``value`` (as TOML or argparse gives it) of the declared type; ints are accepted for floats."""
    if value is None and (opt.nullable or opt.type is list):
        return None
    if isinstance(value, str) and value in opt.words:
        return value
    t = opt.type
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif t is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"{name}: expected {_TYPE_NAMES[t]}, got {value!r}")
    return value


def check_range(opt: Option, value: Any, name: str) -> None:
    """Finite, within ``low``/``high``, one of ``choices``; ``None`` passes where it is allowed."""
    if value is None or (isinstance(value, str) and value in opt.words):
        return
    if opt.type in (int, float):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        if opt.low is not None and not (value > opt.low if opt.strict else value >= opt.low):
            raise ValueError(f"{name} must be {'>' if opt.strict else '>='} {opt.low:g}, got {value}")
        if opt.high is not None and value > opt.high:
            raise ValueError(f"{name} must be <= {opt.high:g}, got {value}")
    choices = opt.choice_list()
    if choices is not None and value not in choices:
        raise ValueError(f"{name} {value!r}: choose one of {', '.join(choices)}")


def parse_key_value(text: str, flag: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE an int, a float, true/false/none, or a string (``--model-option``)."""
    if "=" not in text or not text.split("=", 1)[0]:
        raise ValueError(f"{flag} {text!r}: expected KEY=VALUE")
    key, raw = text.split("=", 1)
    low = raw.lower()
    if low in ("true", "false"):
        return key, low == "true"
    if low == "none":
        return key, None
    for cast in (int, float):
        try:
            return key, cast(raw)
        except ValueError:
            pass
    return key, raw


def check_value(opt: Option, value: Any, name: str) -> Any:
    """``check_type`` then ``check_range``; the checked value."""
    value = check_type(opt, value, name)
    check_range(opt, value, name)
    return value
