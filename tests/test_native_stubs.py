"""The hand-written stubs (python/layertap/_native.pyi) match the built extension: the same
names, the same members, the same parameters. A stub that drifts from the module fails here."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import layertap
import layertap._native as native

STUB = Path(layertap.__file__).with_name("_native.pyi")


def _stub_tree() -> dict[str, ast.AST]:
    tree = ast.parse(STUB.read_text())
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    rest = [p for p in (a.vararg, a.kwarg) if p is not None]
    return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, *rest] if p.arg != "self"]


def _runtime_params(obj) -> list[str] | None:
    if not getattr(obj, "__text_signature__", None):
        return None
    return [p for p in inspect.signature(obj).parameters if p != "self"]


def _public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def test_every_name_is_stubbed_and_exists():
    stub = _stub_tree()
    assert _public(stub) == _public(dir(native)), "stub and module define different names"


def test_class_members_and_signatures_match():
    for name, node in _stub_tree().items():
        obj = getattr(native, name)
        if isinstance(node, ast.ClassDef):
            stub_members = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
            stub_attrs = {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            assert _public(stub_members) | stub_attrs == _public(dir(obj)), f"{name}: members differ"
            for member, fn in stub_members.items():
                runtime = _runtime_params(obj if member == "__init__" else getattr(obj, member))
                if runtime is not None and not any(
                    isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list
                ):
                    assert _params(fn) == runtime, f"{name}.{member}: parameters differ"
        elif isinstance(node, ast.FunctionDef):
            assert _params(node) == _runtime_params(obj), f"{name}: parameters differ"
