"""Layout rules checked from the source tree: every package (and its data) is declared in
pyproject.toml, the core has no import cycles (between modules, or between its packages), and no
tracked symlink points outside the checkout."""

from __future__ import annotations

import ast
import fnmatch
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIRS = {"mllm_rl": ROOT / "mllm_rl", "mllm_rl.backends": ROOT / "backends"}


def package_tree() -> dict[str, Path]:
    """Every directory below the package roots that holds files, as dotted name -> path
    (a directory holding only directories, like ``mllm_rl/assets``, is just part of a path)."""
    out = {}
    for root_name, root in PACKAGE_DIRS.items():
        for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
            if "__pycache__" not in d.parts and any(p.is_file() for p in d.iterdir()):
                out[".".join([root_name, *d.relative_to(root).parts])] = d
    return out


def test_every_package_directory_is_declared():
    """A directory missing from ``packages`` is silently left out of a built wheel."""
    declared, present = set(SETUPTOOLS["packages"]), set(package_tree())
    assert sorted(present - declared) == [], "directories missing from [tool.setuptools] packages"
    assert sorted(declared - present) == [], "declared packages that do not exist"
    assert {k: str(ROOT / v) for k, v in SETUPTOOLS["package-dir"].items()} == {
        k: str(v) for k, v in PACKAGE_DIRS.items()
    }


def test_every_data_file_is_declared_as_package_data():
    data = SETUPTOOLS.get("package-data", {})
    missing = []
    for name, d in package_tree().items():
        for f in sorted(p for p in d.iterdir() if p.is_file() and p.suffix not in (".py", ".pyc")):
            if not any(fnmatch.fnmatch(f.name, g) for g in data.get(name, [])):
                missing.append(f"{name}: {f.name}")
    assert missing == []


def import_graph() -> dict[str, set[str]]:
    """Module -> the core modules it imports (module level and inside functions alike)."""
    modules = {}
    for p in (ROOT / "mllm_rl").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, p in modules.items():
        package = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    graph[m].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_core_modules_import_no_cycle():
    assert cycles(import_graph()) == []


def test_core_packages_import_no_cycle():
    """``mllm_rl.X`` (a module or a subpackage as a whole) never imports back into itself."""
    top = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    graph: dict[str, set[str]] = {}
    for m, targets in import_graph().items():
        graph.setdefault(top(m), set()).update(top(t) for t in targets if top(t) != top(m))
    for targets in list(graph.values()):
        for t in targets:
            graph.setdefault(t, set())
    assert cycles(graph) == []


def symlinks_leaving(root: Path, tracked: list[str]) -> list[str]:
    """Tracked paths that are symlinks pointing outside ``root`` (a link to a local venv or
    checkout works on one machine only, and a clean checkout's ``make test`` trips on it)."""
    out = []
    for rel in tracked:
        p = root / rel
        if p.is_symlink() and not p.resolve().is_relative_to(root.resolve()):
            out.append(rel)
    return out


def test_no_tracked_symlink_leaves_the_checkout(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert symlinks_leaving(ROOT, tracked.stdout.splitlines()) == []
    (tmp_path / "in").write_text("x")
    (tmp_path / "ok").symlink_to(tmp_path / "in")
    (tmp_path / ".venv-jax").symlink_to("/nonexistent/.venv-jax")
    assert symlinks_leaving(tmp_path, ["ok", ".venv-jax", "in"]) == [".venv-jax"]
