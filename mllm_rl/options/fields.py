"""Dataclass fields bound to the schema's options: one default, one check, one way in.

A field declared ``opt("kl_beta")`` takes the option's default, is checked by the option's own rule
(``check_fields``: the same ``range_problem`` as the flag and the tasks-file key), and ``from_args``
fills it from an argparse namespace (or a dict) by the option's key, whatever the field is called.
``opt(key, default=...)`` is a field whose own default stands for the option's ``None`` ("the plan
chooses"); ``opt(key, given=True)`` one whose value the caller derives from the option's (``--lr``
unset: the model's default) and passes to ``from_args``.
"""

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
    """Every bound field of ``obj`` valid by its option's rule; ``OptionError`` naming the option key
    (``kl_beta must be >= 0, got -1.0``: the flag's message with the key in place of the flag)."""
    for f in dataclasses.fields(obj):
        key = f.metadata.get(OPTION)
        if key is not None:
            problem = range_problem(BY_KEY[key], getattr(obj, f.name))
            if problem is not None:
                raise OptionError(key, problem)


def from_args(cls: type[T], args: argparse.Namespace | Mapping[str, Any], **given: Any) -> T:
    """``cls`` with each bound field from ``args`` by its option key, ``given`` for the rest (nested
    options, derived values). A bound field neither in ``args`` nor given is a ``KeyError``, as is a
    ``given=True`` field not given: a namespace that lacks an option is a caller's mistake."""
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
