"""vLLM's model classes as its installed source says, read without importing vLLM (10-20 s of
CPU): which class its registry names for an architecture, whether that class has the EAGLE-3
interface that ``extract_hidden_states`` needs, and whether it runs through the Transformers
backend. The source is parsed (``ast``) and each class's bases followed through the modules they
are imported from; where that does not settle it, the answer is None and nothing is refused.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
from dataclasses import dataclass

#: The interface ``extract_hidden_states`` checks for (``supports_eagle3``) at start-up.
EAGLE3_INTERFACE = "SupportsEagle3"
#: The registry module's entry for vLLM's Transformers backend
#: (``vllm/model_executor/models/transformers/``).
TRANSFORMERS_BACKEND = "transformers"
_REGISTRY = ("model_executor", "models", "registry.py")
_MODELS_PACKAGE = "vllm.model_executor.models"
#: Base classes followed at most this deep (vLLM's model classes are a few levels at most).
_MAX_DEPTH = 12


def package_dir() -> str | None:
    """The directory of the installed ``vllm`` package (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):  # a broken install, or sys.modules["vllm"] = None
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


@dataclass(frozen=True)
class ModelClass:
    """The class vLLM would run for a model."""

    architecture: str
    class_name: str
    transformers_backend: bool
    eagle3: bool | None
    """None: the source does not say."""


@functools.cache
def _parse(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _module_file(root: str, module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "vllm":
        return None
    base = os.path.join(root, *parts[1:])
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _top_level(tree: ast.Module):
    """The module's top-level statements, those under a top-level ``if`` or ``try`` too."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.If, ast.Try)):
            stack.extend(reversed(node.body + node.orelse + getattr(node, "finalbody", [])))
            for handler in getattr(node, "handlers", []):
                stack.extend(reversed(handler.body))
        else:
            yield node


def _imported_from(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def registry(root: str) -> dict[str, tuple[str, str]]:
    """Architecture -> (module, class) as vLLM's ``registry.py`` lists them (its ``*_MODELS``
    dictionaries, later ones overriding earlier ones as in ``_VLLM_MODELS``)."""
    tree = _parse(os.path.join(root, *_REGISTRY))
    out: dict[str, tuple[str, str]] = {}
    if tree is None:
        return out
    for node in _top_level(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)):
            continue
        if not any(isinstance(t, ast.Name) and t.id.endswith("_MODELS") for t in node.targets):
            continue
        for key, value in zip(node.value.keys, node.value.values):
            try:
                k, v = ast.literal_eval(key) if key is not None else None, ast.literal_eval(value)
            except ValueError:
                continue
            if isinstance(k, str) and isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, str) for x in v):
                out[k] = v
    return out


def _root_name(expr: ast.expr) -> str | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
        expr = expr.value if not isinstance(expr, ast.Call) else expr.func
    return expr.id if isinstance(expr, ast.Name) else None


def _has_interface(root: str, module: str, name: str, depth: int = 0) -> bool | None:
    """Whether class ``name`` of ``module`` has the EAGLE-3 interface among its bases."""
    path = _module_file(root, module)
    tree = _parse(path) if path else None
    if tree is None or depth > _MAX_DEPTH:
        return None
    is_package = path.endswith("__init__.py")  # type: ignore[union-attr]
    classes, imports = {}, {}
    for node in _top_level(tree):
        if isinstance(node, ast.ClassDef):
            classes[node.name] = node
        elif isinstance(node, ast.ImportFrom):
            source = _imported_from(module, node, is_package)
            for alias in node.names:
                imports[alias.asname or alias.name] = (source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imports[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
    if name not in classes:
        if name in imports and imports[name][1] is not None:  # re-exported from another module
            source, original = imports[name]
            return _has_interface(root, source, original, depth + 1) if source.startswith("vllm") else None
        return None
    cls = classes[name]
    if any(isinstance(n, ast.FunctionDef) and n.name == "set_aux_hidden_state_layers" for n in cls.body):
        return None  # the protocol's method written out: isinstance may hold without the base
    unknown = False
    for base in cls.bases:
        if isinstance(base, ast.Attribute) and base.attr == EAGLE3_INTERFACE:
            return True
        base_name = base.id if isinstance(base, ast.Name) else None
        if base_name == EAGLE3_INTERFACE:
            return True
        if base_name in classes:
            found = _has_interface(root, module, base_name, depth + 1)
        elif base_name in imports and imports[base_name][1] is not None:
            source, original = imports[base_name]
            # Bases from outside vLLM (torch's nn.Module, typing's Protocol) hold no vLLM interface.
            found = _has_interface(root, source, original, depth + 1) if source.startswith("vllm") else False
        else:
            top = _root_name(base)
            found = False if top in imports and not imports[top][0].startswith("vllm") else None
        if found:
            return True
        unknown = unknown or found is None
    return None if unknown else False


#: A line of vLLM's own capture in DeepSeek's model (``deepseek_v2.py``, 0.32): for each recorded
#: id it adds the residual before the layer runs, where the first layer's ``residual`` is still
#: None, so id 0 fails after start-up (``TypeError: unsupported operand type(s) for +``).
_RESIDUAL_BEFORE_FIRST_LAYER = "aux_hidden_state = hidden_states + residual"


def cannot_record_layer_zero(architecture: str, root: str | None = None) -> bool:
    """Whether vLLM's own capture in the module of ``architecture``'s class fails on layer id 0."""
    root = root or package_dir()
    entry = registry(root).get(architecture) if root else None
    if entry is None:
        return False
    module = entry[0] if entry[0].startswith("vllm.") else f"{_MODELS_PACKAGE}.{entry[0]}"
    path = _module_file(root, module)
    if path is None:
        return False
    with open(path, encoding="utf-8") as f:
        return any(line.strip() == _RESIDUAL_BEFORE_FIRST_LAYER for line in f)


def model_class(architectures: list[str], model_impl: str = "auto", root: str | None = None) -> ModelClass | None:
    """The class vLLM resolves for ``architectures``, as vLLM 0.26-0.33's registry does
    (``inspect_model_cls``): the first architecture it lists, else (and with
    ``model_impl="transformers"``) its Transformers backend. None when the source does not say."""
    root = root or package_dir()
    if root is None or not architectures or model_impl not in ("auto", "vllm", "transformers"):
        return None
    first = architectures[0]
    if model_impl == "transformers":
        return ModelClass(first, "TransformersForCausalLM", True, True)
    models = registry(root)
    if not models:
        return None
    for arch in architectures:
        if arch in models:
            module, name = models[arch]
            if module == TRANSFORMERS_BACKEND:
                return ModelClass(arch, name, True, True)
            full = module if module.startswith("vllm.") else f"{_MODELS_PACKAGE}.{module}"
            return ModelClass(arch, name, False, _has_interface(root, full, name))
    if model_impl == "auto":  # not in vLLM's registry: its Transformers backend, if anything
        return ModelClass(first, "TransformersForCausalLM", True, True)
    return None


__all__ = ["EAGLE3_INTERFACE", "ModelClass", "cannot_record_layer_zero", "model_class", "package_dir", "registry"]
