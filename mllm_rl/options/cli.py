"""The command-line side of the schema: argparse flags from ``schema.OPTIONS`` (added with
``default=SUPPRESS``, so ``parse`` knows which the user typed: ``--resume`` and the scope check
need that), their values checked, and a flag that does not apply refused."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from mllm_rl.options.check import check_range
from mllm_rl.options.schema import BY_KEY, OPTIONS, Option, in_scope

_SCOPE_WORDS = {"rl": "--plan rl", "swap": "--plan swap", "tasks": "--tasks", "memplan": "memplan"}


def help_text(opt: Option, default: Any) -> str:
    """The flag's help with its default said once."""
    if opt.required or opt.type is bool:
        return opt.help
    said = opt.default_text
    if said is None:
        if default is None:
            return opt.help
        said = str(default)
    elif said.startswith("mllm_rl."):  # "module.NAME": a constant said where it is defined
        module, name = said.rsplit(".", 1)
        import importlib

        value = getattr(importlib.import_module(module), name)
        said = ", ".join(f"{v} ({k})" for k, v in value.items()) if isinstance(value, dict) else f"{value:g}"
    return f"{opt.help} (default: {said})"


def add_options(
    ap: argparse.ArgumentParser, scopes: Sequence[str], overrides: dict[str, Any] | None = None
) -> None:
    """Add the flags of ``scopes``, grouped by ``group`` (``overrides``: this command's defaults)."""
    overrides = overrides or {}
    sections: dict[str, Any] = {}
    keys = {o.key for scope in scopes for o in in_scope(scope)}
    for opt in (o for o in OPTIONS if o.key in keys):
        default = overrides.get(opt.key, opt.default)
        where: Any = ap
        if opt.group != "run":
            if opt.group not in sections:
                sections[opt.group] = ap.add_argument_group(opt.group)
            where = sections[opt.group]
        kw: dict[str, Any] = {"dest": opt.key, "default": argparse.SUPPRESS, "help": help_text(opt, default)}
        if opt.metavar:
            kw["metavar"] = opt.metavar
        if opt.type is bool:
            kw["action"] = "store_true"
        elif opt.type is list:
            kw["action"] = "append"
        else:
            kw["type"] = _with_words(opt.type, opt.words) if opt.words else opt.type
            if opt.renamed:
                kw["type"] = _refusing_renamed(opt)
            choices = opt.choice_list()
            if choices is not None:
                kw["choices"] = list(choices)
        if opt.required and opt.key not in overrides:
            kw["required"] = True
        where.add_argument(opt.flag, *opt.aliases, **kw)


def _with_words(cast: Any, words: tuple[str, ...]) -> Any:
    """argparse ``type`` of a number that also takes ``words`` (``--kv-tokens auto``)."""

    def convert(text: str) -> Any:
        return text if text in words else cast(text)

    convert.__name__ = cast.__name__  # argparse names the type in its error: "invalid int value"
    return convert


def _refusing_renamed(opt: Option) -> Any:
    """argparse ``type`` of a choice that refuses an old name of a value, naming the new one."""

    def convert(text: str) -> str:
        new = opt.renamed_to(text)
        if new is not None:
            raise argparse.ArgumentTypeError(f"{text!r} is called {new!r} now: pass {opt.flag} {new}")
        return text

    convert.__name__ = opt.type.__name__
    return convert


def parse(
    ap: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    scopes: Sequence[str],
    overrides: dict[str, Any] | None = None,
) -> tuple[argparse.Namespace, set[str]]:
    """Parse; the namespace with every default of ``scopes`` filled in, and the keys the user gave."""
    overrides = overrides or {}
    ns = ap.parse_args(argv)
    given = {k for k in vars(ns) if k in BY_KEY}
    for scope in scopes:
        for opt in in_scope(scope):
            if opt.key not in given:
                setattr(ns, opt.key, overrides.get(opt.key, opt.default))
    return ns, given


def said(opt: Option, value: Any) -> str:
    """How the user typed it: ``--lr 0.1``, ``--quiet``, ``--prompt``."""
    if opt.type in (bool, list) or value is None:
        return opt.flag
    return f"{opt.flag} {value}"


def check_scope(ns: argparse.Namespace, given: set[str], mode: str, where: str = "") -> None:
    """Refuse a flag given that ``mode`` (or ``--backend``) does not take (one-line ``ValueError``)."""
    for key in sorted(given, key=list(BY_KEY).index):
        opt = BY_KEY[key]
        if mode in opt.scope:
            backend = getattr(ns, "backend", None)
            if opt.backends is not None and backend not in opt.backends:
                takers = " and ".join(f"--backend {b}" for b in sorted(opt.backends))
                verb = "takes" if len(opt.backends) == 1 else "take"
                raise ValueError(f"{said(opt, getattr(ns, key, None))}: only {takers} {verb} it")
            continue
        if mode == "tasks" and "task" in opt.scope:
            why = f"with --tasks it is set per task: put {opt.key} in {where}'s [[task]] or [defaults] table"
        elif mode == "tasks":
            why = "not taken with --tasks (every task is an RL task of the tasks file)"
        else:
            takers = [_SCOPE_WORDS[s] for s in ("rl", "swap", "tasks") if s in opt.scope]
            verb = "takes" if len(takers) == 1 else "take"
            why = f"only {' and '.join(takers)} {verb} it" if takers else "not a flag of this command"
        raise ValueError(f"{said(opt, getattr(ns, key, None))}: {why}")


def check_values(ns: argparse.Namespace, scope: str) -> None:
    """Every value of ``scope`` finite and in range (argparse checked the types and choices)."""
    for opt in in_scope(scope):
        check_range(opt, getattr(ns, opt.key, None), opt.flag)
