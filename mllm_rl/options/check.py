"""One check of a setting's value, the same for a flag, a tasks-file key and a memplan flag: a
one-line ``ValueError`` starting with ``name``, the flag or key (``--lr must be >= 0, got nan``);
``check_output_dir``, a directory a command will write into, checked before any work; and dataclass
fields bound to the schema's options: ``opt("kl_beta")`` takes the option's default, is checked by
its rule (``check_fields``) and filled by ``from_args`` by the option's key. ``opt(key,
default=...)``: the field's own default stands for the option's ``None``; ``opt(key, given=True)``:
the caller derives the value and passes it to ``from_args``."""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from mllm_rl.option_error import OptionError
from mllm_rl.options.schema import BY_KEY, Option

NAME_MAX = 255  # bytes of one name in a path (Linux and macOS file systems)

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


def range_problem(opt: Option, value: Any) -> str | None:
    """What is wrong with ``value`` (``must be >= 1, got 0``), or None: a finite number within
    ``low``/``high`` (else ``why``), one of ``choices``, not an old name of one."""
    if value is None or (isinstance(value, str) and value in opt.words):
        return None
    if opt.type in (int, float):
        if isinstance(value, bool) or not isinstance(
            value, numbers.Integral if opt.type is int else numbers.Real
        ):
            return f"must be {'an integer' if opt.type is int else 'a number'}, got {value!r}"
        if not math.isfinite(value):
            return f"must be a finite number, got {value}"
        below = opt.low is not None and not (value > opt.low if opt.strict else value >= opt.low)
        above = opt.high is not None and value > opt.high
        if (below or above) and opt.why:
            return f"{value}: {opt.why}"
        if below:
            return f"must be {'>' if opt.strict else '>='} {opt.low:g}, got {value}"
        if above:
            return f"must be <= {opt.high:g}, got {value}"
    new = opt.renamed_to(value)
    if new is not None:
        return f"{value!r} is called {new!r} now: use {new!r}"
    choices = opt.choice_list()
    if choices is not None and value not in choices:
        return f"{value!r}: choose one of {', '.join(choices)}"
    return None


def check_range(opt: Option, value: Any, name: str) -> None:
    """``ValueError`` (``<name> <range_problem>``) unless ``value`` is in range."""
    problem = range_problem(opt, value)
    if problem is not None:
        raise ValueError(f"{name} {problem}")


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
    value = check_type(opt, value, name)
    check_range(opt, value, name)
    return value


def check_names(path: Path, flag: str) -> None:
    """No name in ``path`` longer than ``NAME_MAX`` bytes (``ValueError`` naming ``flag``)."""
    for name in path.parts:
        size = len(os.fsencode(name))
        if size > NAME_MAX:
            shown = str(path).replace(name, f"{name[:20]}...{name[-8:]}")
            raise ValueError(
                f"{flag} {shown}: a name of {size} bytes in it; a file name is at most {NAME_MAX} bytes"
            )


def check_output_dir(path: Path, flag: str) -> Path:
    """``path`` can be created and written: names fit, no ancestor is a file, and the nearest
    existing directory (returned) takes a new file (tried: ``os.access`` says yes to root on a
    read-only file system); else ``ValueError`` starting with ``flag``."""
    check_names(path, flag)
    existing = path
    try:
        while not existing.exists():
            if existing.parent == existing:
                break
            existing = existing.parent
        if not existing.is_dir():
            what = "is a file" if existing == path else f"is inside {existing}, a file"
            raise ValueError(f"{flag} {path}: {what}, not a directory")
        fd, probe = tempfile.mkstemp(prefix=".mllm_rl-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = "" if existing == path else f" ({existing} is not)"
        raise ValueError(f"{flag} {path}: not writable{where}: {e.strerror or e}") from None
    return existing


OPTION = "option"  # metadata: the option key a field is bound to
GIVEN = "given"  # metadata: True when ``from_args`` takes the value from its caller, not the namespace
OWN_DEFAULT = "own_default"  # metadata: True when the field's default is not the option's
_SCHEMA: Any = object()

T = TypeVar("T")


def opt(key: str, *, default: Any = _SCHEMA, given: bool = False) -> Any:
    """A dataclass field bound to option ``key`` (``KeyError`` for a key the schema does not declare)."""
    option = BY_KEY[key]
    own = default is not _SCHEMA
    meta = {OPTION: key, GIVEN: given, OWN_DEFAULT: own}
    return dataclasses.field(default=default if own else option.default, metadata=meta)


def bound(cls: Any) -> dict[str, str]:
    """``{field name: option key}`` of the fields of dataclass ``cls`` bound to an option."""
    return {f.name: f.metadata[OPTION] for f in dataclasses.fields(cls) if OPTION in f.metadata}


def check_fields(obj: Any) -> None:
    """Every bound field of ``obj`` valid by its option's rule; else ``OptionError`` naming the key."""
    for f in dataclasses.fields(obj):
        key = f.metadata.get(OPTION)
        if key is not None:
            problem = range_problem(BY_KEY[key], getattr(obj, f.name))
            if problem is not None:
                raise OptionError(key, problem)


def from_args(cls: type[T], args: argparse.Namespace | Mapping[str, Any], **given: Any) -> T:
    """``cls`` with each bound field from ``args`` by its option key, ``given`` for the rest; a bound
    field in neither (or a ``given=True`` one not given) is a caller's mistake: ``KeyError``."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in given or OPTION not in f.metadata:
            continue
        key = f.metadata[OPTION]
        if f.metadata[GIVEN]:
            raise KeyError(f"{cls.__name__}.{f.name}: derived from {key}, to be given")
        if key not in values:
            raise KeyError(f"{cls.__name__}.{f.name}: option {key} is not in the arguments")
        kw[f.name] = values[key]
    return cls(**kw, **given)
