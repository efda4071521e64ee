"""What a torch module's source binds at its top level, read without importing the module.

The helper of ``torchpatch check`` answers from here for modules it has not imported: importing
``torch._inductor.config`` and its like costs seconds each, while a ``def``, a ``class`` or an
assignment at the top level of the file says as much about that name. Only positive facts are taken
from the source: a name it does not bind plainly (bound by an import, under an ``if`` or ``try``,
made dynamically) is left to an import.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
from typing import Dict, FrozenSet, Optional, Tuple

# Calls that may return a module: a value made by one is not taken for a plain attribute.
_MODULE_CALLS = frozenset({"import_module", "__import__", "reload", "LazyModule", "_LazyModule"})


def module_file(root: str, name: str) -> Optional[Tuple[str, bool]]:
    """The source of module ``name`` (``torch.a.b``) under ``root``, the directory of its top package:
    (path, whether it is a package); None where the import system would not load it from a plain
    ``.py`` file (an extension module, a namespace package, nothing there)."""
    base = os.path.join(root, *name.split(".")[1:])
    if os.path.isdir(base):
        init = os.path.join(base, "__init__.py")
        return (init, True) if os.path.isfile(init) else None
    if glob.glob(glob.escape(base) + ".*.so") or os.path.exists(base + ".so") or os.path.exists(base + ".pyd"):
        return None  # an extension module comes first
    return (base + ".py", False) if os.path.isfile(base + ".py") else None


class Bindings:
    """The names a module's top level binds plainly to something that is not a module (``plain``),
    the names it imports unconditionally (``imports``: name -> (module, name there), or (module, "")
    for ``import a.b as name``), the names it binds otherwise (``other``: under an ``if`` or ``try``,
    aliases, more than once), and whether it makes names dynamically (a module ``__getattr__``, a
    star import, ``globals()``)."""

    def __init__(self, plain: FrozenSet[str], imports: Dict[str, Tuple[str, str]], other: FrozenSet[str],
                 dynamic: bool) -> None:
        self.plain = plain
        self.imports = imports
        self.other = other
        self.dynamic = dynamic


def _bound_anywhere(stmt: ast.stmt) -> FrozenSet[str]:
    """Every name a compound statement may bind (its nested functions' locals too: more is safe)."""
    names = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _plain_value(value: Optional[ast.expr]) -> bool:
    """Whether an assigned value is surely no module: not a name or attribute (which may alias
    one), not a call of an import function."""
    if value is None or isinstance(value, (ast.Name, ast.Attribute)):
        return False
    for node in ast.walk(value):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called in _MODULE_CALLS:
                return False
    return True


def _targets(target: ast.expr) -> FrozenSet[str]:
    if isinstance(target, ast.Name):
        return frozenset({target.id})
    if isinstance(target, (ast.Tuple, ast.List)):
        return frozenset(n for t in target.elts for n in _targets(t))
    return frozenset()


def _absolute(module: str, is_package: bool, stmt: ast.ImportFrom) -> str:
    """The module an ``from ... import`` statement of ``module`` names, relative imports resolved."""
    if not stmt.level:
        return stmt.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = parts[:len(parts) - stmt.level + 1]
    return ".".join(base + ([stmt.module] if stmt.module else []))


@functools.lru_cache(maxsize=None)
def bindings(path: str, module: str, is_package: bool) -> Optional[Bindings]:
    """The :class:`Bindings` of ``module``, whose source is ``path``; None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    plain, other = set(), set()
    imports: Dict[str, Tuple[str, str]] = {}
    seen: Dict[str, int] = {}
    dynamic = False

    def bind(name: str) -> None:
        seen[name] = seen.get(name, 0) + 1

    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            plain.add(stmt.name)
            bind(stmt.name)
            dynamic |= stmt.name == "__getattr__"
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = frozenset(n for t in targets for n in _targets(t))
            (plain if _plain_value(stmt.value) else other).update(names)
            for n in names:
                bind(n)
        elif isinstance(stmt, ast.ImportFrom):
            source = _absolute(module, is_package, stmt)
            for alias in stmt.names:
                if alias.name == "*":
                    dynamic = True
                    continue
                imports[alias.asname or alias.name] = (source, alias.name)
                bind(alias.asname or alias.name)
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    imports[alias.asname] = (alias.name, "")
                    bind(alias.asname)
                else:
                    other.add(alias.name.split(".")[0])
        else:  # del, if, try, with, for, ...
            other.update(_bound_anywhere(stmt))
    other.update(n for n, count in seen.items() if count > 1)  # bound twice: which one holds is not plain
    top_level = [stmt for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    dynamic |= any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("globals", "setattr")
                   for stmt in top_level for node in ast.walk(stmt))  # names made or replaced as the module runs
    return Bindings(frozenset(plain - other), {k: v for k, v in imports.items() if k not in other},
                    frozenset(other), dynamic)


def static_child(root: str, module: str, name: str, depth: int = 0) -> Optional[Dict[str, str]]:
    """What ``module.name`` is, from the sources under ``root`` alone: ``{"kind": "attr"}`` for a
    plain top-level binding (or one imported from another module of torch where it is plain),
    ``{"kind": "module", "name": ...}`` for a submodule file or an imported module of torch; None
    where the sources do not say."""
    found = module_file(root, module) if depth < 8 else None
    if found is None:
        return None
    path, is_package = found
    binds = bindings(path, module, is_package)
    if binds is None:
        return None
    if name in binds.plain:
        return {"kind": "attr"}
    top = module.split(".")[0]
    if name in binds.imports:
        source, there = binds.imports[name]
        if source != top and not source.startswith(top + "."):
            return None  # another package's: not read here
        if not there:  # import a.b as name
            return {"kind": "module", "name": source} if module_file(root, source) else None
        return static_child(root, source, there, depth + 1)
    full = f"{module}.{name}"
    if is_package and not binds.dynamic and name not in binds.other and module_file(root, full) is not None:
        return {"kind": "module", "name": full}
    return None
