"""Layering rules of the architecture (README "Layout", docs/internals.md), checked by walking every
import in proxy/ (AST, incl. lazy ones).

Lowest first: hot path (stdlib only) -> settings, errors, sampling -> protocol, tokenizer, media -> models,
quant -> engine -> api -> cli. No module imports itself back through others (no import circle, lazy
imports and the package ``__init__`` an import runs included). Nothing imports api or cli but the
entry points (``python -m proxy``, ``python -m proxy.models``); scheduler
and block manager never import torch; only the proxy.api package imports starlette and only cli.py
imports uvicorn; the api layer reaches the engine only through proxy.engine.client (the EngineClient
seam).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "proxy"

LAYERS = [  # (module prefix, layer); the longest matching prefix wins
    ("proxy.hotpath", 0),
    ("proxy", 0),
    ("proxy.settings", 1), ("proxy.settings_groups", 1), ("proxy.errors", 1), ("proxy.sampling", 1),
    ("proxy.metrics", 1),
    ("proxy.catalog", 1), ("proxy.model_memory", 1),
    ("proxy.protocol", 2), ("proxy.tokenizer", 2), ("proxy.tools", 2), ("proxy.reasoning", 2),
    ("proxy.decode_table", 2), ("proxy.media", 2),
    ("proxy.models", 3), ("proxy.quant", 3),
    ("proxy.engine", 4),
    ("proxy.pipeline", 5),
    ("proxy.api", 6),
    # entry points (``python -m proxy.models`` is ``streamproxy models``)
    ("proxy.cli", 7), ("proxy.models.__main__", 7),
    ("proxy.__main__", 8),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(name: str) -> int:
    best = max((p for p, _ in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names if mod.startswith("proxy"))
    return found


MODULES = {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def proxy_imports(mod: str) -> set[str]:
    """Imported proxy modules (names that are modules or packages of this tree)."""
    return {i for i in MODULES[mod] if i in MODULES}


def test_walk_found_the_tree():
    assert {"proxy.protocol", "proxy.api.app", "proxy.cli", "proxy.engine.output"} <= set(MODULES)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_upward_imports(mod):
    for dep in proxy_imports(mod):
        if dep == mod or dep.startswith(mod + ".") or mod.startswith(dep + "."):
            continue  # a package and its own modules
        assert layer(dep) <= layer(mod), f"{mod} (layer {layer(mod)}) imports {dep} (layer {layer(dep)})"


def import_edges(mod: str) -> set[str]:
    """Modules that importing ``mod`` runs: its imports and the packages above each (their
    ``__init__`` runs first), less ``mod``'s own packages (run before it) and ``mod`` itself."""
    own = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
    edges = set()
    for dep in proxy_imports(mod):
        parts = dep.split(".")
        edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {e for e in edges if e in MODULES and e not in own and e != mod}


def test_no_import_circle():
    """No module reaches itself through its imports (a circle works only in some import orders and
    hides which side is lower); Tarjan's strongly connected components over :func:`import_edges`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(mod: str) -> None:
        index[mod] = low[mod] = len(index)
        stack.append(mod)
        for dep in import_edges(mod):
            if dep not in index:
                visit(dep)
                low[mod] = min(low[mod], low[dep])
            elif dep in stack:
                low[mod] = min(low[mod], index[dep])
        if low[mod] == index[mod]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == mod:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for mod in sorted(MODULES):
        if mod not in index:
            visit(mod)
    assert circles == []


def test_models_and_quant_never_import_the_engine():
    lower = [m for m in MODULES
             if m.startswith(("proxy.models", "proxy.quant")) and m != "proxy.models.__main__"]
    assert "proxy.models.load" in lower and "proxy.quant.dense_prefill" in lower
    for mod in lower:
        assert not {d for d in proxy_imports(mod) if d.startswith("proxy.engine")}, mod


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_nothing_imports_api_or_cli(mod):
    if mod.startswith("proxy.api") or mod in ("proxy.cli", "proxy.__main__", "proxy.models.__main__"):
        return
    bad = {d for d in MODULES[mod] if d.startswith(("proxy.api", "proxy.cli"))}
    assert not bad, f"{mod} imports {bad}"


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if m.startswith("proxy.hotpath")))
def test_hot_path_is_stdlib_only(mod):
    for dep in MODULES[mod]:
        top = dep.split(".")[0]
        assert top in sys.stdlib_module_names or dep.startswith("proxy.hotpath") or dep == "proxy", \
            f"{mod} imports {dep}"


@pytest.mark.parametrize(("library", "allowed"), [("starlette", "proxy.api"), ("uvicorn", "proxy.cli")])
def test_only_one_place_imports_the_web_stack(library, allowed):
    users = {
        m for m, deps in MODULES.items() if any(d == library or d.startswith(library + ".") for d in deps)
    }
    assert users and all(m == allowed or m.startswith(allowed + ".") for m in users), users


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if m.startswith(("proxy.api", "proxy.pipeline"))))
def test_api_sees_the_engine_only_through_the_engine_client(mod):
    engine = {d for d in proxy_imports(mod) if d.startswith("proxy.engine")}
    assert engine <= {"proxy.engine.client", "proxy.engine.factory"}, f"{mod} imports {engine}"


def test_scheduler_and_block_manager_never_import_torch():
    for mod in ("proxy.engine.scheduler", "proxy.engine.block_manager"):
        assert mod in MODULES
        for name in (m for m in MODULES if m == mod or m.startswith(mod + ".")):  # a package's modules too
            assert not any(d.split(".")[0] == "torch" for d in MODULES[name]), name
    code = ("import sys, proxy.engine.scheduler, proxy.engine.block_manager; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]; "
            "assert not bad, bad")
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT.parent,
    )
    assert out.returncode == 0, out.stderr[-2000:]
