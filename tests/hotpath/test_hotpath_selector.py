"""The selector in proxy.hotpath: compiled unless STREAMPROXY_PURE_PYTHON=1; CI requires it compiled."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import hotpath
from proxy.hotpath import python

# Each name of the twin's API -> the extension module that defines it (``ext/NAME.pyx`` -> ``_NAME``).
COMPILED_MODULE_OF = {
    "utf8_complete_prefix_len": "proxy.hotpath._utf8",
    "DecodeTable": "proxy.hotpath._detokenizer",
    "IncrementalDetokenizer": "proxy.hotpath._detokenizer",
    "StopChecker": "proxy.hotpath._stop_checker",
    "ChunkFramer": "proxy.hotpath._framer",
    "EventFramer": "proxy.hotpath._framer",
    "dumps": "proxy.hotpath._framer",
}
STUBS = sorted(Path(hotpath.__file__).parent.glob("_*.pyi"))


def test_compiled_loaded_when_required():
    """With STREAMPROXY_REQUIRE_COMPILED=1 (``make test``), a missing or broken build fails here."""
    if (
        os.environ.get("STREAMPROXY_REQUIRE_COMPILED") != "1"
        or os.environ.get("STREAMPROXY_PURE_PYTHON") == "1"
    ):
        assert hotpath.IS_COMPILED == (hotpath.COMPILED_IMPORT_ERROR is None
                                       and os.environ.get("STREAMPROXY_PURE_PYTHON") != "1")
        return
    assert hotpath.IS_COMPILED, f"compiled hot path failed to import: {hotpath.COMPILED_IMPORT_ERROR}"
    assert {name: getattr(hotpath, name).__module__ for name in COMPILED_MODULE_OF} == COMPILED_MODULE_OF


def _probe(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop("STREAMPROXY_PURE_PYTHON", None)
    if env_value is not None:
        env["STREAMPROXY_PURE_PYTHON"] = env_value
    code = "import proxy.hotpath as h; print(h.IS_COMPILED, h.StopChecker.__module__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_env_forces_pure_python():
    assert _probe("1") == "False proxy.hotpath.python.stop_checker"


def test_selected_names_match_twin_api():
    for name in ("DecodeTable", "IncrementalDetokenizer", "StopChecker", "ChunkFramer", "dumps"):
        assert getattr(hotpath, name).__name__ == getattr(python, name).__name__
    if hotpath.IS_COMPILED:
        assert _probe(None) == "True proxy.hotpath._stop_checker"


@pytest.mark.parametrize("missing", sorted(set(COMPILED_MODULE_OF.values())))
def test_any_missing_compiled_module_falls_back_as_a_whole(missing: str):
    """One extension module missing (not built, or failing to load): the selector exports the pure-Python
    twin for every name, never a mix, and ``COMPILED_IMPORT_ERROR`` names the module, so
    ``test_compiled_loaded_when_required`` fails loudly under ``STREAMPROXY_REQUIRE_COMPILED=1``."""
    if not hotpath.IS_COMPILED:
        pytest.skip("the compiled hot path is not built (test_compiled_loaded_when_required covers CI)")
    env = dict(os.environ)
    env.pop("STREAMPROXY_PURE_PYTHON", None)
    code = (f"import sys; sys.modules[{missing!r}] = None\n"  # makes ``import`` of it raise ImportError
            "import proxy.hotpath as h\n"
            "print(h.IS_COMPILED, sorted({getattr(h, n).__module__ for n in h.__all__ if not n.isupper()}))\n"
            "print(h.COMPILED_IMPORT_ERROR)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == ("False ['proxy.hotpath.python.detokenizer', 'proxy.hotpath.python.framer', "
                      "'proxy.hotpath.python.stop_checker', 'proxy.hotpath.python.utf8']")
    assert out[1] == f"ModuleNotFoundError: import of {missing} halted; None in sys.modules"


def _stub_signature(fn: ast.FunctionDef) -> tuple[list[tuple[str, str | None, bool]], str | None]:
    a = fn.args
    params = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(params) - len(a.defaults)) + list(a.defaults)
    return ([(p.arg, ast.unparse(p.annotation) if p.annotation else None, d is not None)
             for p, d in zip(params, defaults)], ast.unparse(fn.returns) if fn.returns else None)


def _twin_signature(obj: object) -> tuple[list[tuple[str, str | None, bool]], str | None]:
    sig = inspect.signature(obj)  # type: ignore[arg-type]
    empty = inspect.Parameter.empty
    return ([(n, None if p.annotation is empty else p.annotation, p.default is not empty)
             for n, p in sig.parameters.items()],
            None if sig.return_annotation is inspect.Signature.empty else sig.return_annotation)


def test_stub_matches_the_python_twin():
    """Type checkers see the compiled modules through their stubs ``_NAME.pyi`` (the selector's
    TYPE_CHECKING branch); the pure-Python twin must have the same names and signatures (parameter
    names, annotations as written, which ones have defaults, return types), so a call site the stubs
    accept runs on either twin. Each compiled module must export every name of its stub."""
    stubs = {f"proxy.hotpath.{p.stem}": ast.parse(p.read_text()) for p in STUBS}
    assert set(stubs) == set(COMPILED_MODULE_OF.values())
    module_of = {n.name: mod for mod, stub in stubs.items() for n in stub.body
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert module_of == COMPILED_MODULE_OF
    assert set(module_of) == set(hotpath.__all__) - {"COMPILED_IMPORT_ERROR", "IS_COMPILED"}
    nodes = [n for stub in stubs.values() for n in stub.body]
    if hotpath.IS_COMPILED:
        from proxy.hotpath import compiled

        assert sorted(compiled.__all__) == sorted(COMPILED_MODULE_OF)
        for name, mod in COMPILED_MODULE_OF.items():
            assert getattr(compiled, name) is getattr(sys.modules[mod], name)
    checked = 0
    for node in nodes:
        if isinstance(node, ast.FunctionDef):
            assert _stub_signature(node) == _twin_signature(getattr(python, node.name)), node.name
            checked += 1
        elif isinstance(node, ast.ClassDef):
            cls = getattr(python, node.name)
            for fn in node.body:
                if not isinstance(fn, ast.FunctionDef):
                    continue
                attr = inspect.getattr_static(cls, fn.name)
                if isinstance(attr, property):
                    assert attr.fget is not None
                    assert _stub_signature(fn)[1] == inspect.signature(attr.fget).return_annotation, fn.name
                else:
                    assert _stub_signature(fn) == _twin_signature(attr), f"{node.name}.{fn.name}"
                checked += 1
    assert checked >= 19
