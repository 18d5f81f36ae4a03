"""The SGLang adapter against the real SGLang, without a GPU.

1. Every entry of ``backends/torch/sglang_calls.py`` (the calls the adapter makes, and
   torch_memory_saver's as ``backends/torch/memory.py`` uses it) is checked against the source
   of the pinned wheels, downloaded once with ``pip download --no-deps`` into ``.whl/``
   (gitignored; offline afterwards) and read with ``zipfile`` + ``ast``, never imported: an
   upstream rename, a dropped keyword, a changed tag or output key fails here. A copy of the
   table with one wrong name proves each check can fail.
2. The adapter reaches SGLang only through that table (checked on its own source).
3. The adapter runs end to end against ``FakeSglang``: a **fake** SGLang whose classes are built
   from the signatures parsed out of the wheel (it refuses any keyword, argument count, literal
   value or sampling key the real one would not take, and records every call), backed by our
   embedded torch engine on CPU so the engine contract (``tests/engine_contract.py``) can
   compare its outputs with Hugging Face. What it checks is our side: drain order, tags,
   chunked updates, version checks. SGLang's own behaviour is not exercised here.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import dataclasses
import importlib
import inspect
import re
import subprocess
import sys
import types
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from mllm_rl.backends.torch import sglang_calls as sc
from tests import engine_contract as contract
from tests.conftest import ROOT

WHEELS = ROOT / ".whl"
ADAPTER = ROOT / "backends/torch/sglang_engine.py"
MEMORY = ROOT / "backends/torch/memory.py"


# -- the wheels ------------------------------------------------------------------------------------
def _wheel(dist: str, version: str) -> Path:
    """The cached wheel of ``dist==version`` in ``.whl/``; downloaded (no dependencies) when absent."""
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    found = sorted(WHEELS.glob(pattern))
    if found:
        return found[-1]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
                        "--platform", "manylinux2014_x86_64", "-d", str(WHEELS), f"{dist}=={version}"],
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    found = sorted(WHEELS.glob(pattern))
    if r.returncode != 0 or not found:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
        pytest.skip(f"{dist}=={version}: not cached in .whl/ and pip download failed ({tail[0]})")
    return found[-1]


class Source:
    """The Python source of one wheel, parsed on demand (never imported)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.zip = zipfile.ZipFile(path)
        self.files = set(self.zip.namelist())
        self._trees: dict[str, ast.Module] = {}

    def file_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for f in (base + ".py", base + "/__init__.py"):
            if f in self.files:
                return f
        return None

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            f = self.file_of(module)
            if f is None:
                raise LookupError(f"module {module} not in {self.path.name}")
            self._trees[module] = ast.parse(self.zip.read(f).decode(), f)
        return self._trees[module]

    def text(self, name: str) -> str:
        return self.zip.read(name).decode()

    def resolve(self, module: str, name: str) -> tuple[str, ast.AST] | None:
        """The module-level definition of ``name`` seen from ``module`` (following ``from X import``)."""
        tree = self.tree(module)
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return module, node
        for node in ast.walk(tree):  # imports, also inside try / if blocks
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    if (a.asname or a.name) == name and self.file_of(node.module):
                        return self.resolve(node.module, a.name)
        return None

    def mro(self, module: str, cls: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases defined in this wheel, depth first."""
        found = self.resolve(module, cls)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return []
        mod, node = found
        out = [(mod, node)]
        for b in node.bases:
            if isinstance(b, ast.Name):
                out += [x for x in self.mro(mod, b.id) if x not in out]
        return out

    def members(self, module: str, cls: str) -> dict[str, ast.AST]:
        """Methods, annotated fields and class attributes of ``cls`` and its bases (the class wins)."""
        out: dict[str, ast.AST] = {}
        for _, node in reversed(self.mro(module, cls)):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    out[item.name] = item
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out[item.target.id] = item
                elif isinstance(item, ast.Assign):
                    for t in item.targets:
                        if isinstance(t, ast.Name):
                            out[t.id] = item
        return out

    def fields(self, module: str, cls: str) -> dict[str, tuple[str, ast.AnnAssign]]:
        """Annotated fields (dataclass / msgspec.Struct) of ``cls`` and its bases, with their module."""
        out: dict[str, tuple[str, ast.AnnAssign]] = {}
        for mod, node in reversed(self.mro(module, cls)):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out[item.target.id] = (mod, item)
        return out

    def self_assigned(self, module: str, cls: str) -> set[str]:
        """Attributes the class's methods assign on ``self``."""
        out = set()
        for _, node in self.mro(module, cls):
            for n in ast.walk(node):
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    if isinstance(n.value, ast.Name) and n.value.id == "self":
                        out.add(n.attr)
        return out


def server_args_fields(src: Source) -> dict[str, tuple[str, ast.AnnAssign]]:
    """``ServerArgs`` fields: the namespaces of ``_INPUT_NAMESPACES`` in ``server_args.py``."""
    mod = "sglang.srt.server_args"
    names: list[str] = []
    for node in src.tree(mod).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                for t in node.targets):  # fmt: skip
            names = [e.id for e in node.value.elts if isinstance(e, ast.Name)]
    out: dict[str, tuple[str, ast.AnnAssign]] = {}
    for n in names:
        found = src.resolve(mod, n)
        if found:
            out.update(src.fields(found[0], n))
    return out


def _strings(src: Source, module: str, node: ast.AST) -> list[Any] | None:
    """A list literal of constants, or a name bound to one (followed through imports)."""
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    if isinstance(node, ast.Name):
        found = src.resolve(module, node.id)
        if found and isinstance(found[1], ast.Assign | ast.AnnAssign) and found[1].value is not None:
            return _strings(src, found[0], found[1].value)
    return None


def allowed_values(src: Source, module: str, ann: ast.AnnAssign) -> list[Any] | None:
    """The values a field accepts when it says: ``Literal[...]`` or ``Arg(choices=...)``; None: any."""
    for n in ast.walk(ann.annotation):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "Literal":
            return _strings(src, module, n.slice) or [n.slice.value]
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Arg":
            for k in n.keywords:
                if k.arg == "choices":
                    return _strings(src, module, k.value)
    return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], int, bool]:
    """(positional parameter names after self, how many have defaults, takes **kwargs)."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args][1:]
    return names, len(a.defaults), a.kwarg is not None


def _yields(fn: ast.AST) -> bool:
    """``fn`` itself yields (nested functions do not count)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Yield | ast.YieldFrom):
            return True
        if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(n))
    return False


def _keys_built(fn: ast.AST) -> set[str]:
    """String keys of dict literals and of ``d["key"] = ...`` assignments inside ``fn``."""
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Dict):
            out |= {k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if (
            isinstance(n, ast.Subscript)
            and isinstance(n.ctx, ast.Store)
            and isinstance(n.slice, ast.Constant)
        ):
            out.add(n.slice.value)
    return out


def _tuple_first_from(fn: ast.FunctionDef, param: str) -> bool:
    """Every returned list of tuples takes element 0 from ``param`` (``zip(param, ...)``)."""
    returns = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    if not returns:
        return False
    for r in returns:
        if (
            isinstance(r, ast.ListComp)
            and isinstance(r.elt, ast.Tuple)
            and isinstance(r.elt.elts[0], ast.Name)
        ):
            gen = r.generators[0]
            names = [t.id for t in getattr(gen.target, "elts", []) if isinstance(t, ast.Name)]
            it = gen.iter
            if not (
                isinstance(it, ast.Call) and getattr(it.func, "id", "") == "zip" and r.elt.elts[0].id in names
            ):
                return False
            src_arg = it.args[names.index(r.elt.elts[0].id)]
        elif isinstance(r, ast.Call) and getattr(r.func, "id", "") == "list" and r.args:
            inner = r.args[0]
            if not (isinstance(inner, ast.Call) and getattr(inner.func, "id", "") == "zip"):
                return False
            src_arg = inner.args[0]
        else:
            return False
        if not (isinstance(src_arg, ast.Name) and src_arg.id == param):
            return False
    return True


def problems(src: Source, c: sc.Call) -> list[str]:  # noqa: C901  (one branch per kind, flat on purpose)
    """What in the wheel contradicts the declared call ``c`` (empty: it conforms)."""
    where = f"{c.module}.{c.owner + '.' if c.owner else ''}{c.name}"
    if src.file_of(c.module) is None:
        return [f"{where}: module {c.module} not in {src.path.name}"]
    out: list[str] = []
    if c.kind in ("kwargs", "fields"):
        cls = c.name if c.kind == "kwargs" else c.owner
        if not src.mro(c.module, cls):
            return [f"{where}: no class {cls}"]
        if c.module == sc.CALLS["Engine"].module and cls == "Engine":
            init = src.members(c.module, "Engine").get("__init__")
            ok = isinstance(init, ast.FunctionDef) and _params(init)[2] and any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "server_args_class"
                and any(k.arg is None for k in n.keywords) for n in ast.walk(init))  # fmt: skip
            if not ok:
                out.append(f"{where}: __init__ no longer forwards **kwargs to server_args_class")
            fields = server_args_fields(src)
        else:
            fields = src.fields(c.module, cls)
        for k in c.kwargs:
            if k not in fields:
                out.append(f"{where}: no field {k!r}")
        for k, vals in c.values:
            if k in fields:
                allowed = allowed_values(src, *fields[k])
                bad = [v for v in vals if allowed is not None and v not in allowed]
                if bad:
                    out.append(f"{where}: {k}={bad} not among {allowed}")
        return out
    if c.kind in ("method", "coroutine", "agen", "absent"):
        members = src.members(c.module, c.owner)
        if not src.mro(c.module, c.owner):
            return [f"{where}: no class {c.owner}"]
        fn = members.get(c.name)
        if c.kind == "absent":
            return (
                [f"{where}: now defined upstream (update the adapter's known gap)"] if fn is not None else []
            )
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            return [f"{where}: no such method"]
        want_async = c.kind != "method"
        if (
            isinstance(fn, ast.AsyncFunctionDef) != want_async
            or (c.kind == "agen") != _yields(fn)
            and want_async
        ):
            out.append(f"{where}: is {'async ' if isinstance(fn, ast.AsyncFunctionDef) else ''}def"
                       f"{' (generator)' if _yields(fn) else ''}, declared {c.kind}")  # fmt: skip
        names, n_defaults, _ = _params(fn)
        if names[: len(c.args)] != list(c.args):
            out.append(f"{where}: positional parameters {names}, declared {list(c.args)}")
        if len(names) - n_defaults > len(c.args):
            out.append(f"{where}: requires {names[: len(names) - n_defaults]}, we pass {list(c.args)}")
        kwonly = [a.arg for a in fn.args.kwonlyargs]
        for k in c.kwargs:
            if k not in names and k not in kwonly:
                out.append(f"{where}: no parameter {k!r}")
        return out
    if c.kind == "attribute":
        if not c.owner:
            return [] if src.resolve(c.module, c.name) else [f"{where}: not defined"]
        if c.name not in src.members(c.module, c.owner) and c.name not in src.self_assigned(
            c.module, c.owner
        ):
            out.append(f"{where}: never assigned or declared")
        return out
    if c.kind == "constant":
        found = src.resolve(c.module, c.name)
        want = dict(c.values)["value"][0]
        value = getattr(getattr(found[1], "value", None), "value", None) if found else None
        return [] if value == want else [f"{where}: = {value!r}, declared {want!r}"]
    if c.kind == "keys":
        fn = src.members(c.module, c.owner).get(c.name)
        if fn is None:
            return [f"{where}: no such method"]
        missing = sorted(set(c.kwargs) - _keys_built(fn))
        return [f"{where}: does not build key(s) {missing}"] if missing else []
    if c.kind == "key_values":
        key, seen = c.kwargs[0], set()
        for n in ast.walk(src.tree(c.module)):
            if isinstance(n, ast.Dict):
                for k, v in zip(n.keys, n.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == key and isinstance(v, ast.Constant):
                        seen.add(v.value)
        missing = sorted(set(dict(c.values)[key]) - seen)
        return [f"{where}: {key!r} never takes {missing} (seen {sorted(seen)})"] if missing else []
    if c.kind == "tuple_first":
        fn = src.members(c.module, c.owner).get(c.name)
        if not isinstance(fn, ast.FunctionDef):
            return [f"{where}: no such method"]
        if c.kwargs[0] not in _params(fn)[0] or not _tuple_first_from(fn, c.kwargs[0]):
            return [f"{where}: entries no longer start with {c.kwargs[0]}"]
        return []
    return [f"{where}: unknown kind {c.kind}"]


@pytest.fixture(scope="module")
def sglang_src() -> Source:
    return Source(_wheel("sglang", sc.SGLANG_VERSION))


@pytest.fixture(scope="module")
def tms_src() -> Source:
    return Source(_wheel("torch-memory-saver", sc.TORCH_MEMORY_SAVER_VERSION))


# -- 1. the table against the wheels ---------------------------------------------------------------
@pytest.mark.parametrize("entry", list(sc.CALLS))
def test_declared_sglang_call_matches_the_wheel(sglang_src, entry):
    assert problems(sglang_src, sc.CALLS[entry]) == []


@pytest.mark.parametrize("entry", list(sc.TMS_CALLS))
def test_declared_torch_memory_saver_call_matches_the_wheel(tms_src, entry):
    assert problems(tms_src, sc.TMS_CALLS[entry]) == []


def test_wheel_is_the_pinned_version(sglang_src, tms_src):
    version = re.search(r"__version__ = version = '([^']+)'", sglang_src.text("sglang/_version.py"))
    assert version and version.group(1) == sc.SGLANG_VERSION
    meta = sglang_src.text(f"sglang-{sc.SGLANG_VERSION}.dist-info/METADATA")
    req = re.search(r"^Requires-Dist: torch_memory_saver(.*)$", meta, re.M)
    assert req, "sglang no longer requires torch_memory_saver"
    from packaging.specifiers import SpecifierSet

    assert sc.TORCH_MEMORY_SAVER_VERSION in SpecifierSet(req.group(1).split(";")[0].strip())
    assert f"torch_memory_saver-{sc.TORCH_MEMORY_SAVER_VERSION}.dist-info/METADATA" in tms_src.files


def _mutations() -> list[tuple[str, str, dict[str, Any]]]:
    """(entry, what is wrong, replacement fields): one deliberate error per kind of check."""
    return [
        ("pause_generation", "coroutine renamed", {"name": "pause_generations"}),
        ("Engine.shutdown", "method renamed", {"name": "close"}),
        ("generate_request", "declared a coroutine, is an async generator", {"kind": "coroutine"}),
        ("update_weights_from_tensor", "positional parameter renamed", {"args": ("req", "request")}),
        ("flush_cache", "an argument too many", {"args": ("obj",)}),
        ("UpdateWeightsFromTensorReqInput", "keyword renamed", {"kwargs": ("serialized_named_tensors",
                                                                           "load_format", "flush")}),
        ("PauseGenerationReqInput", "literal not allowed", {"values": (("mode", ("drain",)),)}),
        ("Engine", "ServerArgs field renamed", {"kwargs": ("model_path", "mem_fraction")}),
        ("Engine", "choice not offered", {"values": (("load_format", ("random",)),)}),
        ("SamplingParams", "sampling key renamed", {"kwargs": ("seed",)}),
        ("Engine.loop", "attribute renamed", {"name": "event_loop"}),
        ("generate_output", "output key renamed", {"kwargs": ("meta",)}),
        ("finish_reason", "finish reason not produced", {"values": (("type", ("stopped",)),)}),
        ("logprob_entry", "entry starts elsewhere", {"kwargs": ("token_logprobs_idx",)}),
        ("TAG_KV", "tag value changed", {"values": (("value", ("kv",)),)}),
        ("qwen3_no_readback", "gap closed upstream",
         {"owner": "LlamaForCausalLM", "module": "sglang.srt.models.llama"}),
        ("FlushCacheReqOutput", "result field renamed", {"kwargs": ("ok",)}),
    ]  # fmt: skip


@pytest.mark.parametrize("entry, what, change", _mutations(), ids=[m[1] for m in _mutations()])
def test_a_wrong_declaration_is_caught(sglang_src, entry, what, change):
    table = copy.deepcopy(sc.CALLS)
    table[entry] = dataclasses.replace(table[entry], **change)
    assert problems(sglang_src, table[entry]), f"not caught: {entry} {what}"


def test_every_check_kind_has_a_mutation():
    kinds = {sc.CALLS[e].kind for e, _, _ in _mutations()}
    assert kinds >= {c.kind for c in sc.CALLS.values()}


# -- 2. the adapter and memory.py use only declared calls -------------------------------------------
_SC_FUNCS = {"construct": ("kwargs",), "invoke": ("method", "coroutine", "agen"), "attr": ("attribute",),
             "key": ("keys", "fields")}  # fmt: skip


def test_adapter_reaches_sglang_only_through_the_table():
    tree = ast.parse(ADAPTER.read_text())
    used, bad = set(), []
    upstream = {"tm", "engine"}  # self.tm, self.engine hold SGLang objects
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _SC_FUNCS:
            if not (isinstance(n.func.value, ast.Name) and n.func.value.id == "sc"):
                continue
            pos = 0 if n.func.attr == "key" else 1
            entry = n.args[pos].value if isinstance(n.args[pos], ast.Constant) else None
            c = sc.CALLS.get(entry)
            if c is None or c.kind not in _SC_FUNCS[n.func.attr]:
                bad.append(f"line {n.lineno}: sc.{n.func.attr}({entry!r}) not declared as such")
                continue
            used.add(entry)
            if n.func.attr == "construct":
                extra = {k.arg for k in n.keywords if k.arg} - set(c.kwargs)
                bad += [f"line {n.lineno}: {entry} keyword {k!r} undeclared" for k in sorted(extra)]
            if n.func.attr == "invoke" and len(n.args) - 2 != len(c.args):
                bad.append(f"line {n.lineno}: {entry} called with {len(n.args) - 2} args, declared {c.args}")
            if n.func.attr == "key" and n.args[1].value not in c.kwargs:
                bad.append(f"line {n.lineno}: key {n.args[1].value!r} not declared in {entry}")
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "CALLS":
            used.add(n.slice.value)  # sc.CALLS["SamplingParams"].kwargs: the sampling keys we send
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr in upstream:
            if isinstance(n.value.value, ast.Name) and n.value.value.id == "self":
                bad.append(f"line {n.lineno}: self.{n.value.attr}.{n.attr} bypasses the table")
        if (
            isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id in ("io", "io_struct", "engine_mod")
        ):
            bad.append(f"line {n.lineno}: {n.value.id}.{n.attr} bypasses the table")  # fmt: skip
    assert not bad, bad
    calls = {
        k for k, c in sc.CALLS.items() if c.kind in ("kwargs", "method", "coroutine", "agen", "attribute")
    }
    assert calls - used == set(), f"declared but never called by the adapter: {sorted(calls - used)}"


def test_adapter_imports_only_sglang_modules(sglang_src):
    tree = ast.parse(ADAPTER.read_text())
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang"):
            for a in n.names:
                assert sglang_src.file_of(f"{n.module}.{a.name}"), (
                    f"from {n.module} import {a.name}: not a module"
                )


def test_memory_py_uses_only_declared_torch_memory_saver_calls():
    tree = ast.parse(MEMORY.read_text())
    used = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "tms":
            used.add(n.attr)
        if (
            isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "torch_memory_saver"
        ):
            used.add(n.attr)
        if isinstance(n, ast.ImportFrom) and n.module == "torch_memory_saver":
            used |= {a.name for a in n.names}
    declared = {c.name for c in sc.TMS_CALLS.values()}
    assert used and used <= declared, f"memory.py uses undeclared torch_memory_saver names: {used - declared}"
    kw = {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "region"
          for k in n.keywords}  # fmt: skip
    assert kw <= set(sc.TMS_CALLS["region"].kwargs)


def test_declared_helpers_refuse_undeclared_use():
    with pytest.raises(sc.UndeclaredCall, match="flush"):
        sc.construct(types.SimpleNamespace(), "UpdateWeightsFromTensorReqInput", flush=True)
    with pytest.raises(sc.UndeclaredCall, match="not declared"):
        sc.invoke(object(), "pause_generations")
    with pytest.raises(sc.UndeclaredCall, match="argument"):
        sc.invoke(object(), "flush_cache", 1)
    with pytest.raises(sc.UndeclaredCall, match="meta"):
        sc.key("generate_output", "meta")


def test_update_buckets_close_at_the_limit():
    items = [(f"t{i}", n, n) for i, n in enumerate([3, 3, 5, 1, 1])]
    got = [([n for _, n in b], closed) for b, closed in sc.update_buckets(items, 6)]
    assert got == [([3, 3], True), ([5, 1], True), ([1], False)]
    assert [closed for _, closed in sc.update_buckets(items[:2], 6)] == [True]


# -- 3. the adapter end to end against a fake built from the wheel ----------------------------------
@dataclasses.dataclass
class Signatures:
    """What the fake accepts, parsed from the wheel."""

    server_args: dict[str, list[Any] | None]  # field -> allowed values (None: any)
    classes: dict[str, dict[str, list[Any] | None]]  # io_struct / sampling class -> field -> allowed values
    methods: dict[str, inspect.Signature]  # tokenizer manager / engine method -> signature
    constants: dict[str, Any]
    version: str


def parse_signatures(src: Source) -> Signatures:
    sa = {k: allowed_values(src, *v) for k, v in server_args_fields(src).items()}
    classes, methods, constants = {}, {}, {}
    for c in sc.CALLS.values():
        if c.kind == "kwargs" and c.name != "Engine":
            classes[c.name] = {k: allowed_values(src, *v) for k, v in src.fields(c.module, c.name).items()}
        if c.kind in ("method", "coroutine", "agen"):
            fn = src.members(c.module, c.owner)[c.name]
            names, n_def, _ = _params(fn)
            params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=None if i >= len(names) - n_def else inspect.Parameter.empty)
                      for i, p in enumerate(names)]  # fmt: skip
            self_ = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
            methods[c.name] = inspect.Signature([self_, *params])
        if c.kind == "constant":
            constants[c.name] = src.resolve(c.module, c.name)[1].value.value
    version = re.search(r"__version__ = version = '([^']+)'", src.text("sglang/_version.py")).group(1)
    return Signatures(sa, classes, methods, constants, version)


class FakeSglang:
    """A **fake** SGLang for driving the adapter on CPU: modules, classes and methods named and
    shaped as parsed from the real wheel, every call checked against those signatures and
    recorded in ``calls``; requests are served by our embedded torch engine (CPU).
    ``readback``: ``get_weights_by_name`` returns the weights (a model that has it) instead of
    ``None`` (Qwen3 in 0.5.23)."""

    def __init__(self, sig: Signatures, readback: bool = True, version: str | None = None,
                 drop: str | None = None) -> None:  # fmt: skip
        self.sig, self.readback, self.calls = sig, readback, []
        self.flush_refusals = 0  # how many flush_cache calls report success=False first
        self.modules = self._build(version or sig.version, drop)

    def record(self, call: str, **info: Any) -> None:
        self.calls.append((call, info))

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def _request_class(self, name: str) -> type:
        fields, fake = self.sig.classes[name], self

        class Req:
            def __init__(self, **kw: Any) -> None:
                unknown = set(kw) - set(fields)
                if unknown:
                    raise TypeError(f"{name}: unexpected keyword(s) {sorted(unknown)}")
                for k, v in kw.items():
                    allowed = fields[k]
                    if allowed is not None and v not in allowed:
                        raise ValueError(f"{name}.{k}={v!r}: not among {allowed}")
                    setattr(self, k, v)
                fake.record(name, **{k: v for k, v in kw.items() if k != "serialized_named_tensors"})

        Req.__name__ = name
        return Req

    def _checked(self, name: str, fn: Any) -> Any:
        sig = self.sig.methods[name]

        def call(*args: Any, **kw: Any) -> Any:
            sig.bind(*args, **kw)  # TypeError exactly where the real signature would refuse
            return fn(*args, **kw)

        return call

    def _build(self, version: str, drop: str | None) -> dict[str, types.ModuleType]:
        fake = self
        mods = {n: types.ModuleType(n) for n in ("sglang", "sglang.srt", "sglang.srt.entrypoints",
                "sglang.srt.entrypoints.engine", "sglang.srt.managers", "sglang.srt.managers.io_struct",
                "sglang.srt.managers.tokenizer_manager", "sglang.srt.sampling",
                "sglang.srt.sampling.sampling_params", "sglang.srt.constants")}  # fmt: skip
        for name, m in mods.items():
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(mods[parent], child, m)
        mods["sglang"].__version__ = version
        for k, v in self.sig.constants.items():
            setattr(mods["sglang.srt.constants"], k, v)
        for c in sc.CALLS.values():
            if c.kind == "kwargs" and c.name != "Engine":
                setattr(mods[c.module], c.name, self._request_class(c.name))

        class TokenizerManager:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

        def tm_method(name: str, impl: Any) -> None:
            setattr(TokenizerManager, name, fake._checked(name, impl))

        async def generate_request(self, obj, request=None):
            sp = dict(obj.sampling_params)
            unknown = set(sp) - set(fake.sig.classes["SamplingParams"])
            if unknown:
                raise TypeError(f"SamplingParams: unexpected keyword(s) {sorted(unknown)}")
            from mllm_rl.engine import SamplingParams

            sampling = SamplingParams(max_new_tokens=sp["max_new_tokens"], temperature=sp["temperature"],
                                      top_p=sp["top_p"], stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                                      seed=sp.get("sampling_seed"))  # fmt: skip
            fake.record("generate_request", seed=sp.get("sampling_seed"))
            o = (await asyncio.to_thread(self.inner.generate, [obj.input_ids], sampling))[0]
            lps = [(lp, t, None) for lp, t in zip(o.logprobs, o.token_ids, strict=True)]
            meta = {"finish_reason": {"type": o.finish_reason}, "output_token_logprobs": lps}
            yield {"text": o.text, "output_ids": list(o.token_ids), "meta_info": meta}

        async def pause_generation(self, obj):
            fake.record("pause_generation", mode=obj.mode)
            self.inner.pause_generation()

        async def continue_generation(self, obj):
            fake.record("continue_generation")
            self.inner.continue_generation()

        async def flush_cache(self, timeout_s=None):
            fake.record("flush_cache")
            ok = fake.flush_refusals <= 0
            fake.flush_refusals -= 1
            self.inner.flush_cache()
            return types.SimpleNamespace(success=ok, message="" if ok else "running requests")

        async def update_weights_from_tensor(self, obj, request=None):
            (payload,) = obj.serialized_named_tensors  # one TP rank
            fake.record("update_weights_from_tensor", names=[n for n, _ in payload], flush=obj.flush_cache)
            await asyncio.to_thread(self.inner.update_weights, payload)
            return True, "Succeeded to update model weights."

        async def get_weights_by_name(self, obj, request=None):
            fake.record("get_weights_by_name", name=obj.name)
            if not fake.readback:
                return None
            p = dict(self.inner.model.named_parameters())[obj.name]
            return p.detach().float().tolist()[: obj.truncate_size]

        async def release_memory_occupation(self, obj, request=None):
            fake.record("release_memory_occupation", tags=list(obj.tags))
            for t in obj.tags:
                if t in self.inner.tags:
                    self.inner.release_memory(t)

        async def resume_memory_occupation(self, obj, request=None):
            fake.record("resume_memory_occupation", tags=list(obj.tags))
            for t in obj.tags:
                if t in self.inner.tags:
                    self.inner.resume_memory(t)

        for name, impl in list(locals().items()):
            if name in sc.CALLS and sc.CALLS[name].owner == "TokenizerManager" and name != drop:
                tm_method(name, impl)

        class Engine:
            def __init__(self, **kw: Any) -> None:
                for k, v in kw.items():
                    if k not in fake.sig.server_args:
                        raise TypeError(f"ServerArgs: unexpected keyword {k!r}")
                    allowed = fake.sig.server_args[k]
                    if allowed is not None and v not in allowed:
                        raise ValueError(f"ServerArgs.{k}={v!r}: not among {allowed}")
                fake.record("Engine", **kw)
                from mllm_rl.backends.torch.engine import EmbeddedEngine
                from mllm_rl.checkpoint.model_dir import ModelDir

                self.inner = EmbeddedEngine(ModelDir.open(kw["model_path"]), max_total_tokens=kw["max_total_tokens"],
                                            context_length=kw["context_length"], seed=kw["random_seed"],
                                            weights_cpu_backup=kw["enable_weights_cpu_backup"],
                                            max_running_requests=kw["max_running_requests"],
                                            device=torch.device("cpu"))  # fmt: skip
                self.tokenizer_manager = TokenizerManager(self.inner)
                self.loop = asyncio.new_event_loop()
                self._scheduler_init_result = types.SimpleNamespace(
                    scheduler_infos=[{"max_total_num_tokens": kw["max_total_tokens"]}]
                )

        def serialize(self, tensors, load_format):
            return [list(tensors)]  # one TP rank, in process (the real one pickles CUDA IPC handles)

        def shutdown(self):
            fake.record("shutdown")
            self.inner.shutdown()

        Engine._serialize_tensors_per_rank = self._checked("_serialize_tensors_per_rank", serialize)
        Engine.shutdown = self._checked("shutdown", shutdown)
        mods["sglang.srt.entrypoints.engine"].Engine = Engine
        mods["sglang.srt.managers.tokenizer_manager"].TokenizerManager = TokenizerManager
        return mods


@pytest.fixture(scope="module")
def signatures(sglang_src) -> Signatures:
    return parse_signatures(sglang_src)


ADAPTER_MODULE = "mllm_rl.backends.torch.sglang_engine"


def load_adapter(monkeypatch, fake: FakeSglang) -> Any:
    """Import the adapter against the fake modules (its import-time version probe runs on them)."""
    for name, mod in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, ADAPTER_MODULE, raising=False)
    mod = importlib.import_module(ADAPTER_MODULE)
    monkeypatch.setattr(mod.SglangEngine, "device", torch.device("cpu"))  # staging: CPU tensors here
    monkeypatch.setattr(mod.SglangEngine, "_free_bytes", lambda self: 0)  # cuda_graph: nothing on CPU
    return mod


@pytest.fixture
def clean_adapter_import():
    yield
    sys.modules.pop(ADAPTER_MODULE, None)  # never leave the fake-backed adapter for other tests


def test_version_probe_refuses_a_missing_call(monkeypatch, signatures, clean_adapter_import):
    fake = FakeSglang(signatures, drop="pause_generation")
    with pytest.raises(RuntimeError, match=r"TokenizerManager\.pause_generation missing"):
        load_adapter(monkeypatch, fake)


def test_version_probe_warns_on_another_version(monkeypatch, signatures, clean_adapter_import):
    with pytest.warns(UserWarning, match="adapter written against"):
        load_adapter(monkeypatch, FakeSglang(signatures, version="0.5.22"))


def test_version_probe_refuses_a_changed_tag(monkeypatch, signatures, clean_adapter_import):
    fake = FakeSglang(dataclasses.replace(signatures, constants={**signatures.constants,
                                                                 "GPU_MEMORY_TYPE_KV_CACHE": "kv"}))  # fmt: skip
    with pytest.raises(RuntimeError, match="GPU_MEMORY_TYPE_KV_CACHE"):
        load_adapter(monkeypatch, fake)


def test_drain_release_update_against_the_fake(monkeypatch, signatures, tiny_ckpt, clean_adapter_import):
    """Our side of the protocol, call by call: tags, drain order, chunked updates, flush retries."""
    from mllm_rl.checkpoint.model_dir import ModelDir
    from mllm_rl.engine import TAG_CUDA_GRAPH, TAG_KV, TAG_WEIGHTS, SamplingParams, WeightExport
    from mllm_rl.engine_state import ManagedEngine

    fake = FakeSglang(signatures)
    mod = load_adapter(monkeypatch, fake)
    model = ModelDir.open(tiny_ckpt)
    raw = mod.SglangEngine(model, max_total_tokens=2048, context_length=64, chunk_bytes=2**20)
    eng = ManagedEngine(raw)
    try:
        started = dict(fake.calls[0][1])
        assert (
            fake.calls[0][0] == "Engine"
            and started["load_format"] == "dummy"
            and started["enable_memory_saver"]
        )
        assert started["mem_fraction_static"] == sc.MEM_FRACTION_STATIC
        stats = eng.update_weights(WeightExport(list(model.tensors), model.iter_tensors(), full=True))
        sent = [i for n, i in fake.calls if n == "update_weights_from_tensor"]
        assert len(sent) > 1, "1 MiB chunks: the tiny model's 3 MiB must go in several calls"
        assert [s["flush"] for s in sent] == [False] * (len(sent) - 1) + [True]
        assert [n for s in sent for n in s["names"]] == list(model.tensors)
        assert stats.tensors == len(model.tensors)
        out = eng.generate([[1, 2, 3]] * 2, SamplingParams(max_new_tokens=4, temperature=1.0, seed=7))
        seeds = [i["seed"] for n, i in fake.calls if n == "generate_request"]
        assert len(set(seeds)) == 2, "each request of a group needs its own seed"
        assert all(1 <= len(o.token_ids) == len(o.logprobs) <= 4 for o in out)

        fake.calls.clear()
        fake.flush_refusals = 2  # SGLang reports success=False while requests linger
        eng.drain()
        eng.release([TAG_KV, TAG_WEIGHTS, TAG_CUDA_GRAPH])
        release = ["ReleaseMemoryOccupationReqInput", "release_memory_occupation"]
        assert fake.names() == [
            "PauseGenerationReqInput",
            "pause_generation",
            *["flush_cache"] * 3,
            *release * 3,
        ]
        assert [i["mode"] for n, i in fake.calls if n == "pause_generation"] == ["abort"]
        tags = [i["tags"] for n, i in fake.calls if n == "release_memory_occupation"]
        assert tags == [[TAG_KV], [TAG_WEIGHTS], [TAG_CUDA_GRAPH]]
        fake.calls.clear()
        eng.resume([TAG_WEIGHTS])
        eng.update_weights(WeightExport(list(model.tensors), model.iter_tensors(), full=True))
        eng.resume([TAG_KV, TAG_CUDA_GRAPH])
        eng.continue_generation()
        names = [n for n in fake.names() if not n.endswith("ReqInput")]
        assert names[0] == "resume_memory_occupation" and names[-1] == "continue_generation"
        assert names.index("continue_generation") > max(
            i for i, n in enumerate(names) if n.startswith("resume")
        )
    finally:
        eng.shutdown()


def test_flush_that_never_succeeds_raises(monkeypatch, signatures, tiny_ckpt, clean_adapter_import):
    from mllm_rl.checkpoint.model_dir import ModelDir

    fake = FakeSglang(signatures)
    mod = load_adapter(monkeypatch, fake)
    raw = mod.SglangEngine(ModelDir.open(tiny_ckpt), max_total_tokens=1024, context_length=64)
    try:
        fake.flush_refusals = 10**6
        with pytest.raises(RuntimeError, match="flush_cache did not succeed"):
            raw.flush_cache(timeout_s=0.2)
    finally:
        raw.shutdown()


def test_qwen3_readback_gap_fails_loudly(monkeypatch, signatures, tiny_ckpt, clean_adapter_import):
    """With 0.5.23's Qwen3 (no get_weights_by_name: None) an update cannot be verified: it raises."""
    from mllm_rl.checkpoint.model_dir import ModelDir
    from mllm_rl.engine import WeightExport
    from mllm_rl.engine_state import ManagedEngine

    fake = FakeSglang(signatures, readback=False)
    mod = load_adapter(monkeypatch, fake)
    model = ModelDir.open(tiny_ckpt)
    eng = ManagedEngine(mod.SglangEngine(model, max_total_tokens=1024, context_length=64))
    try:
        with pytest.raises(RuntimeError, match="returned None"):
            eng.update_weights(WeightExport(list(model.tensors), model.iter_tensors(), full=True))
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_engine_contract_against_the_fake(
    monkeypatch, signatures, tiny_ckpt, hf_logits, clean_adapter_import
):
    """The whole engine contract through the adapter and the fake (outputs from our embedded
    engine, checked against Hugging Face): the adapter's request building and output parsing."""
    from mllm_rl.backends.torch.probe import tracked_cpu_bytes

    fake = FakeSglang(signatures)
    mod = load_adapter(monkeypatch, fake)

    def make(backup: bool) -> Any:
        return mod.SglangEngine(contract_model(tiny_ckpt), max_total_tokens=4096, context_length=512,
                                weights_cpu_backup=backup)  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        obs = contract.run_contract(make, tiny_ckpt, lambda: tracked_cpu_bytes()[0])
    for check in contract.CONTRACT_TESTS.values():
        args = {"obs": obs, "ref_logits": hf_logits}
        check(*(args[p] for p in check.__code__.co_varnames[: check.__code__.co_argcount]))
    coroutines = {c.name for c in sc.CALLS.values() if c.kind in ("coroutine", "agen")}
    assert {n for n, _ in fake.calls} >= coroutines  # every tokenizer-manager call was exercised


def contract_model(path: Path) -> Any:
    from mllm_rl.checkpoint.model_dir import ModelDir

    return ModelDir.open(path)
