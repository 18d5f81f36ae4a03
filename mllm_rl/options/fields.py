"""Dataclass fields bound to the schema's options: ``opt("kl_beta")`` takes the option's default,
is checked by its rule (``check_fields``) and filled by ``from_args`` by the option's key.
``opt(key, default=...)``: the field's own default stands for the option's ``None``; ``opt(key,
given=True)``: the caller derives the value and passes it to ``from_args``."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from mllm_rl.option_error import OptionError
from mllm_rl.options.check import range_problem
from mllm_rl.options.schema import BY_KEY

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
