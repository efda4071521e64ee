"""``torchpatch check``: a static pre-flight scan of a repository's torch names against one torch.

Every ``.py`` file is parsed (never executed). The scan collects each torch name the code uses
(``import torch.x.y``, ``from torch.x import a``, attribute chains on imported torch modules,
``torch.ops.<ns>.<op>``) together with the import guards around it, and resolves each name on the
target torch: natively, through a patch of the catalogue (its module shims, aliases and symbols,
as data), or not at all. This module knows nothing about particular torch APIs: what exists comes
from the inventories in ``patches/_inventory`` (``tools/inventory.py``) or, for the installed
torch, from a helper interpreter that imports torch once; what torchpatch serves comes from the
patches' declarations; features that cannot be backported from ``patches/not_backportable.json``.
"""

from __future__ import annotations

import ast
import bisect
import functools
import gc
import gzip
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from . import _versions
from ._config import Config, decide
from ._manager import _applicability
from ._patch import Patch
from ._registry import all_patches

ROOT = "torch"
OPS = "torch.ops"
MODULE, ATTR, MISSING, UNKNOWN = "module", "attr", "missing", "unknown"
NATIVE, PATCHED, UNRESOLVED, GUARDED = "native", "patched", "unresolved", "guarded"
KINDS = (UNRESOLVED, GUARDED, UNKNOWN, PATCHED, NATIVE)  # report order
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}


def _catalogue_dir() -> Path:
    from . import patches

    return Path(patches.__file__).resolve().parent


# -- what exists: inventories and the live torch ----------------------------------------------------
Lookup = Tuple[str, str, str]  # (MODULE | ATTR | MISSING | UNKNOWN, real module name for MODULE, note)


def inventory_files() -> Dict[str, Path]:
    """Inventoried torch versions (release strings) and their files, oldest first."""
    found = {p.name[len("torch-"):-len(".json.gz")]: p for p in (_catalogue_dir() / "_inventory").glob("torch-*.json.gz")}
    return dict(sorted(found.items(), key=lambda kv: _versions.release(kv[0]) or ()))


class Inventory:
    """One torch version's inventory: every module of the walked packages with its names."""

    def __init__(self, data: Dict[str, Any]) -> None:
        self.version: str = data["torch"]
        self.python: str = data.get("python", "?")
        self.modules: Dict[str, Dict[str, str]] = data["modules"]
        self.failing: Dict[str, str] = data["failing"]
        self.walked: Tuple[str, ...] = tuple(data.get("walked", ()))
        self.walk_skips: Set[str] = set(data.get("walk_skips", ()))

    @classmethod
    @functools.lru_cache(maxsize=None)
    def load(cls, path: Path) -> "Inventory":
        return cls(json.loads(gzip.decompress(path.read_bytes())))

    def walked_whole(self, module: str) -> bool:
        """Whether every submodule of ``module`` would be listed (its package was walked)."""
        return any(module == root or module.startswith(root + ".") for root in self.walked) and not (
            self.walk_skips.intersection(module.split(".")))

    def attribute_kind(self, module: str, name: str) -> Optional[str]:
        """MODULE or ATTR where this inventory knows ``module.name``, else None."""
        full = f"{module}.{name}"
        if full in self.modules or full in self.failing:
            return MODULE
        value = self.modules.get(module, {}).get(name)
        return None if value is None else MODULE if value == "<module>" else ATTR


class InventoryView:
    """What exists on an inventoried torch. ``others`` (every inventory) tell a name that is
    absent here but known elsewhere (missing) from one nobody looked at (unknown)."""

    def __init__(self, inv: Inventory, others: Sequence[Inventory]) -> None:
        self.inv = inv
        self.others = others
        self.label = f"torch {inv.version}'s inventory"

    def child(self, module: str, name: str) -> Lookup:
        inv, full = self.inv, f"{module}.{name}"
        if module in inv.failing:
            return UNKNOWN, "", self._failed(module)
        if full in inv.modules:
            return MODULE, full, ""
        if full in inv.failing:
            return UNKNOWN, "", self._failed(full)
        names = inv.modules.get(module)
        if names is None:
            return UNKNOWN, "", f"{module} is not in {self.label}"
        value = names.get(name)
        if value is not None:
            return (MODULE, full, "") if value == "<module>" else (ATTR, "", "")
        if inv.walked_whole(module) and name not in inv.walk_skips:
            return MISSING, "", ""
        if any(o.attribute_kind(module, name) == ATTR for o in self.others):
            return MISSING, "", ""  # an attribute elsewhere, so not a submodule that was not looked at
        return UNKNOWN, "", f"{module} was not walked for submodules in {self.label}"

    def close(self) -> None:
        pass

    def op(self, namespace: str, name: str) -> Lookup:
        return UNKNOWN, "", f"{self.label} has no operator list: needs a live torch"

    def _failed(self, module: str) -> str:
        return (f"{module} failed to import when {self.label} was taken (Python {self.inv.python}): "
                f"{self.inv.failing[module]}")


_LIVE_SERVER = r'''
import importlib, importlib.util, json, sys, types, warnings
warnings.simplefilter("ignore")
out = sys.stdout
sys.stdout = sys.stderr  # whatever torch prints must not garble the answers
try:
    import torch
    BROKEN = None
except BaseException as exc:
    BROKEN = "torch does not import here: %s: %s" % (type(exc).__name__, exc)
MODULES, NAMESPACES = {}, None

def module(name):
    if name not in MODULES:
        try:
            MODULES[name] = importlib.import_module(name)
        except BaseException as exc:
            MODULES[name] = "%s fails to import here (torchpatch off): %s: %s" % (name, type(exc).__name__, exc)
    return MODULES[name]

def child(name, part):
    mod = module(name)
    if isinstance(mod, str):
        return ["unknown", "", mod[:400]]
    full = name + "." + part
    try:
        value = getattr(mod, part)
    except Exception:
        value = None
    else:
        if isinstance(value, types.ModuleType):
            return ["module", value.__name__ if value.__name__.startswith("torch") else full, ""]
        return ["attr", "", ""]
    if not hasattr(mod, "__path__"):
        return ["missing", "", ""]
    try:
        spec = importlib.util.find_spec(full)
    except BaseException:
        spec = None
    if spec is None:
        return ["missing", "", ""]
    sub = module(full)
    return ["unknown", "", sub[:400]] if isinstance(sub, str) else ["module", full, ""]

def namespaces():
    global NAMESPACES
    if NAMESPACES is None:
        try:
            names = torch._C._dispatch_get_all_op_names()
        except AttributeError:
            names = [s.name for s in torch._C._jit_get_all_schemas()]
        NAMESPACES = {n.split("::")[0] for n in names}
    return NAMESPACES

def op(namespace, name):
    module("torch.distributed")  # registers the Python-defined collective ops where torch has them
    try:
        getattr(getattr(torch.ops, namespace), name)
        return ["attr", "", ""]
    except Exception:
        pass
    if namespace in namespaces():
        return ["missing", "", ""]
    return ["unknown", "", "no operator namespace %r in this torch: registered at run time by an extension or your code, if at all" % namespace]

for line in sys.stdin:
    query = json.loads(line)
    if BROKEN:
        answer = ["unknown", "", BROKEN]
    elif query[0] == "op":
        answer = op(query[1], query[2])
    else:
        answer = child(query[1], query[2])
    out.write(json.dumps(answer) + "\n")
    out.flush()
'''


class LiveView:
    """What exists on the installed torch, asked of a helper interpreter (this Python, torchpatch
    off) that imports torch once, on the first question."""

    label = "the installed torch"

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._memo: Dict[Tuple[str, str, str], Lookup] = {}

    def _ask(self, *query: str) -> Lookup:
        if query in self._memo:
            return self._memo[query]
        if self._proc is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPATCH")}
            self._proc = subprocess.Popen([sys.executable, "-c", _LIVE_SERVER], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        answer: Lookup = (UNKNOWN, "", "the helper interpreter that imports torch stopped")
        try:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(query) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            if line:
                answer = tuple(json.loads(line))  # type: ignore[assignment]
        except (OSError, ValueError):
            pass
        self._memo[query] = answer
        return answer

    def child(self, module: str, name: str) -> Lookup:
        return self._ask("child", module, name)

    def op(self, namespace: str, name: str) -> Lookup:
        return self._ask("op", namespace, name)

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.communicate(timeout=30)
            except (subprocess.TimeoutExpired, OSError, ValueError):
                self._proc.kill()
            self._proc = None


class LayeredView:
    """The inventory first; what it cannot decide goes to the live torch."""

    def __init__(self, first: InventoryView, live: LiveView) -> None:
        self.first, self.live = first, live
        self.label = f"{first.label} and the installed torch"

    def child(self, module: str, name: str) -> Lookup:
        found = self.first.child(module, name)
        return self.live.child(module, name) if found[0] == UNKNOWN else found

    def op(self, namespace: str, name: str) -> Lookup:
        found = self.first.op(namespace, name)
        return self.live.op(namespace, name) if found[0] == UNKNOWN else found

    def close(self) -> None:
        self.live.close()


# -- what torchpatch serves: the catalogue's declarations --------------------------------------------
@dataclass
class Serving:
    """The catalogue's module shims, aliases and symbols that serve a name on one torch version."""

    shims: Dict[str, str] = field(default_factory=dict)  # module -> patch id
    aliases: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # module -> (target, patch id)
    symbols: Dict[Tuple[str, str], str] = field(default_factory=dict)  # (module, name) -> patch id
    off: Dict[str, str] = field(default_factory=dict)  # name a switched-off patch would serve -> why

    @classmethod
    def for_torch(cls, version: str, patches: Sequence[Patch], cfg: Config) -> "Serving":
        applicability = {p.id: _applicability(p.torch, p.python, version) for p in patches}
        decisions = decide(cfg, patches, inapplicable={i for i, (applies, _) in applicability.items() if not applies})
        out = cls()
        for p in patches:
            if not applicability[p.id][0]:
                continue
            on = decisions[p.id].enabled
            symbols = list(p.symbols) + [(m, n) for m, n, spec in p.hook_symbols if _versions.matches(spec, version)]
            served = list(p.modules) + [n for n, _t, spec in p.aliases if _versions.matches(spec, version)]
            served += [f"{m}.{n}" for m, n in symbols]
            if not on:
                for name in served:
                    out.off.setdefault(name, f"patch {p.id} would serve it but is off ({decisions[p.id].reason})")
                continue
            for name in p.modules:
                out.shims.setdefault(name, p.id)
            for name, target, spec in p.aliases:
                if _versions.matches(spec, version):
                    out.aliases.setdefault(name, (target, p.id))
            for key in symbols:
                out.symbols.setdefault(key, p.id)
        return out


# -- resolving one name ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    status: str  # NATIVE | PATCHED | MISSING | UNKNOWN
    key: str  # the name the row is about: cut after the first attribute, missing or undecided part
    patches: Tuple[str, ...] = ()
    how: Tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class _Mod:
    shown: str  # the name the code uses
    real: str  # the torch module whose contents it has ("" for a torchpatch shim)
    shim: str = ""  # patch id serving it as a shim
    shim_name: str = ""  # the name the shim is served under


class Resolver:
    """Resolves dotted torch names on one torch version: natively (``view``) or via ``serving``."""

    def __init__(self, view: Any, version: str, serving: Optional[Serving] = None) -> None:
        self.view = view
        self.version = version
        self.serving = serving or Serving()
        self._memo: Dict[str, Result] = {}
        self._modules: Dict[str, Tuple[str, Optional[_Mod], str]] = {}

    def resolve(self, name: str) -> Result:
        if name not in self._memo:
            self._memo[name] = self._resolve(name)
        return self._memo[name]

    def _resolve(self, name: str) -> Result:
        parts = name.split(".")
        if name.startswith(OPS + ".") and len(parts) >= 4:
            return self._op(parts)
        mod, patches, how = _Mod(ROOT, ROOT), (), ()  # type: _Mod, Tuple[str, ...], Tuple[str, ...]
        for part in parts[1:]:
            shown = f"{mod.shown}.{part}"
            kind, target, served_by, text, note = self._child(mod, part, 0)
            if served_by:
                patches, how = patches + (served_by,) * (served_by not in patches), how + (text,)
            if kind == MODULE:
                mod = target
                continue
            if kind == ATTR:
                return Result(PATCHED if patches else NATIVE, shown, patches, how, note)
            entry = not_backportable_for(name)
            if kind == UNKNOWN and entry and not _versions.matches(entry["torch"], self.version):
                return Result(MISSING, name, patches, how, f"only torch {entry['torch']} has it ({note})")
            return Result(kind, shown, patches, how, note or self.serving.off.get(shown, ""))
        return Result(PATCHED if patches else NATIVE, name, patches, how)

    def _child(self, mod: _Mod, part: str, depth: int) -> Tuple[str, Any, str, str, str]:
        """(kind, _Mod for a module, serving patch id, how it is served, note) for ``mod.part``."""
        shown = f"{mod.shown}.{part}"
        undecided = ""
        if mod.real:
            kind, real, note = self.view.child(mod.real, part)
            if kind == MODULE:
                return MODULE, _Mod(shown, real), "", "", ""
            if kind == ATTR:
                return ATTR, None, "", "", ""
            if kind == UNKNOWN:
                undecided = note
        found = self._served(mod, part, depth)
        if found is None:
            return (UNKNOWN, None, "", "", undecided) if undecided else (MISSING, None, "", "", "")
        if undecided:  # native or served, it resolves: say which is not known
            kind, target, patch, how, note = found
            return kind, target, patch, f"{how}, where torch lacks it", "; ".join(n for n in (note, undecided) if n)
        return found

    def _served(self, mod: _Mod, part: str, depth: int) -> Optional[Tuple[str, Any, str, str, str]]:
        """What the catalogue serves as ``mod.part`` (as for :meth:`_child`), or None."""
        shown = f"{mod.shown}.{part}"
        s = self.serving
        if shown in s.aliases and depth < 8:
            target, patch = s.aliases[shown]
            kind, found, note = self._module(target, depth + 1)
            if found is not None:
                return MODULE, _Mod(shown, found.real, found.shim, found.shim_name), patch, f"{shown} = {target} ({patch})", ""
            if kind == UNKNOWN:
                return UNKNOWN, None, "", "", f"{patch} serves it as {target}, if that imports: {note}"
        if shown in s.shims:
            patch = s.shims[shown]
            return MODULE, _Mod(shown, "", patch, shown), patch, f"module {shown} served by {patch}", ""
        for module in dict.fromkeys(m for m in (mod.shown, mod.real, mod.shim_name) if m):
            if (module, part) in s.symbols:
                patch = s.symbols[(module, part)]
                return ATTR, None, patch, f"{module}.{part} served by {patch}", ""
        if mod.shim and not not_backportable_for(shown):
            return (ATTR, None, mod.shim, f"inside module {mod.shown}, which {mod.shim} serves",
                    f"{mod.shown} is a torchpatch shim; the names it holds are not declared, so {part} is not checked")
        return None

    def _module(self, name: str, depth: int) -> Tuple[str, Optional[_Mod], str]:
        """``name`` as a module (natively or served), for an alias target: (kind, module, note)."""
        if name not in self._modules:
            self._modules[name] = (MISSING, None, "")  # a cycle of aliases ends here
            mod: _Mod = _Mod(ROOT, ROOT)
            for part in name.split(".")[1:]:
                kind, target, _patch, _how, note = self._child(mod, part, depth)
                if kind != MODULE:
                    self._modules[name] = (UNKNOWN if kind == UNKNOWN else MISSING, None, note)
                    return self._modules[name]
                mod = target
            self._modules[name] = (MODULE, mod, "")
        return self._modules[name]

    def _op(self, parts: List[str]) -> Result:
        key = ".".join(parts[:4])
        namespace, op = parts[2], parts[3]
        patch = self.serving.symbols.get((f"{OPS}.{namespace}", op))
        kind, _real, note = self.view.op(namespace, op)
        if kind == ATTR:
            return Result(NATIVE, key)
        if patch:  # missing, or undecided: then native or served, it resolves
            how = f"{key} served by {patch}" + (", where torch lacks it" if kind == UNKNOWN else "")
            return Result(PATCHED, key, (patch,), (how,), note)
        return Result(kind, key, note=note or self.serving.off.get(key, ""))


# -- scanning sources --------------------------------------------------------------------------------
_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception", "BaseException"}
_GUARD_CALLS = {"hasattr", "getattr", "find_spec", "find_loader"}
_GUARD_WORDS = re.compile(r"version|type_checking|greater|newer|older|at_?least|less_than|(?:^|_)(?:ge|gt|le|lt)(?:_|\d|$)",
                          re.IGNORECASE)


@dataclass
class Guard:
    kind: str  # "try" | "fallback" (an except branch of a "try") | "if" | "with" | "annotation"
    text: str
    partner: int = -1  # for a fallback: the index of its "try" guard


@dataclass
class FileScan:
    path: str
    names: List[Tuple[str, int, Tuple[int, ...]]] = field(default_factory=list)  # (name, line, guard indices)
    guards: List[Guard] = field(default_factory=list)
    error: str = ""
    error_line: int = 0


def _dotted(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else ""


def _catches_import_errors(handler: ast.ExceptHandler) -> bool:
    return handler.type is None or any(n in _IMPORT_ERRORS for n in _exception_names(handler))


def _is_guard_test(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        ident = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
        if ident is not None and (ident in _GUARD_CALLS or _GUARD_WORDS.search(ident)):
            return True
    return False


def _suppresses_import_errors(item: ast.withitem) -> bool:
    call = item.context_expr
    return (isinstance(call, ast.Call) and _dotted(call.func).rsplit(".", 1)[-1] == "suppress"
            and any(_dotted(a).rsplit(".", 1)[-1] in _IMPORT_ERRORS for a in call.args))


_NEWLINE = re.compile(rb"\n")


def _torch_imports(source: bytes) -> List[int]:
    """Offsets of ``import`` on lines that also say ``torch`` (where a torch import may start)."""
    found = []
    at = source.find(b"import")
    while at != -1:
        start, end = source.rfind(b"\n", 0, at) + 1, source.find(b"\n", at)
        if source.find(b"torch", start, end if end != -1 else len(source)) != -1:
            found.append(at)
        at = source.find(b"import", at + 6)
    return found


def _lines(source: bytes, offsets: List[int]) -> List[int]:
    """The (1-based) line numbers of byte ``offsets`` in ``source``."""
    lines, line, previous = [], 1, 0
    for at in sorted(offsets):
        line += source.count(b"\n", previous, at)
        previous = at
        lines.append(line)
    return lines


_TRY = (ast.Try, ast.TryStar) if hasattr(ast, "TryStar") else (ast.Try,)


def _is_torch(module: Optional[str]) -> bool:
    return bool(module) and (module == ROOT or module.startswith(ROOT + "."))  # type: ignore[union-attr]


def _exception_names(handler: ast.ExceptHandler) -> List[str]:
    if handler.type is None:
        return []
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return [_dotted(t).rsplit(".", 1)[-1] for t in types]


class _Scanner:
    """One file: its torch imports and the attribute chains on the names they bind."""

    def __init__(self, scan: FileScan, source: bytes) -> None:
        self.scan, self.source = scan, source
        self.bound: Dict[str, str] = {}  # local name -> torch dotted name
        self.lazy_annotations = False
        self.flagged: List[int] = []  # lines with a torch import or a bound name followed by a dot
        self.starts: List[int] = []  # byte offset of each line, made when a guard's text needs it

    # pass 1: the names torch imports bind; the lines worth a look
    def prepare(self, tree: ast.Module) -> None:
        source = self.source
        self.flagged = _lines(source, _torch_imports(source))
        self.lazy_annotations = any(isinstance(s, ast.ImportFrom) and s.module == "__future__"
                                    and any(a.name == "annotations" for a in s.names) for s in tree.body)
        self.bindings(tree.body)
        uses = []
        for name in self.bound:  # `name.`; a chain broken across lines before its first dot is not flagged
            needle = name.encode() + b"."
            at = source.find(needle)
            while at != -1:
                uses.append(at)
                at = source.find(needle, at + 1)
        self.flagged = sorted(set(self.flagged).union(_lines(source, uses)))

    def bindings(self, body: Sequence[ast.stmt]) -> None:
        for stmt in body:
            if not self._touches(stmt):
                continue
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if _is_torch(alias.name):
                        self.bound[alias.asname or ROOT] = alias.name if alias.asname else ROOT
            elif isinstance(stmt, ast.ImportFrom):
                if not stmt.level and _is_torch(stmt.module):
                    for alias in stmt.names:
                        if alias.name != "*":
                            self.bound[alias.asname or alias.name] = f"{stmt.module}.{alias.name}"
            else:
                for inner in _stmt_lists(stmt):
                    self.bindings(inner)

    def _touches(self, node: ast.stmt) -> bool:
        i = bisect.bisect_left(self.flagged, node.lineno)
        return i < len(self.flagged) and self.flagged[i] <= (node.end_lineno or node.lineno)

    def _guard(self, kind: str, node: ast.AST, what: str, partner: int = -1) -> int:
        """A new guard; ``{}`` in ``what`` becomes the source of ``node``."""
        if "{}" in what:  # offsets are in bytes of the UTF-8 source
            if not self.starts:
                self.starts = [0] + [m.end() for m in _NEWLINE.finditer(self.source)]
            start = self.starts[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
            end = self.starts[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]
            segment = " ".join(self.source[start:end].decode("utf-8", "replace").split())
            what = what.format(segment if len(segment) <= 60 else segment[:57] + "...")
        self.scan.guards.append(Guard(kind, f"{what} ({self.scan.path}:{getattr(node, 'lineno', 0)})", partner))
        return len(self.scan.guards) - 1

    def _annotation_guards(self, node: ast.AST, guards: Tuple[int, ...]) -> Tuple[int, ...]:
        if not self.lazy_annotations:
            return guards
        return guards + (self._guard("annotation", node, "annotation, not evaluated (from __future__ import annotations)"),)

    # pass 2: statements with their guards, where a flagged line is
    def body(self, stmts: Sequence[ast.stmt], guards: Tuple[int, ...]) -> None:
        for stmt in stmts:
            if self._touches(stmt):
                self.stmt(stmt, guards)

    def stmt(self, stmt: ast.stmt, guards: Tuple[int, ...]) -> None:
        names = self.scan.names
        if isinstance(stmt, ast.Import):
            names += [(a.name, stmt.lineno, guards) for a in stmt.names if _is_torch(a.name)]
        elif isinstance(stmt, ast.ImportFrom):
            if not stmt.level and _is_torch(stmt.module):
                names += [(stmt.module if a.name == "*" else f"{stmt.module}.{a.name}", stmt.lineno, guards)
                          for a in stmt.names]
        elif isinstance(stmt, ast.If):
            if _is_guard_test(stmt.test):
                guards = guards + (self._guard("if", stmt.test, "if {}"),)
            self.expr(stmt.test, guards)
            self.body(stmt.body, guards)
            self.body(stmt.orelse, guards)
        elif isinstance(stmt, _TRY):
            catching = [h for h in stmt.handlers if _catches_import_errors(h)]
            inner = fallback = guards
            if catching:
                caught = "/".join(sorted({n for h in catching for n in _exception_names(h)})) or "(bare)"
                tried = self._guard("try", stmt, f"try/except {caught}")
                inner = guards + (tried,)
                fallback = guards + (self._guard("fallback", catching[0], f"except {caught}, the fallback", tried),)
            self.body(stmt.body, inner)
            for handler in stmt.handlers:
                if handler.type is not None:
                    self.expr(handler.type, guards)
                self.body(handler.body, fallback if handler in catching else guards)
            self.body(stmt.orelse, guards)
            self.body(stmt.finalbody, guards)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            self.expr(stmt.items, guards)
            if any(_suppresses_import_errors(item) for item in stmt.items):
                guards = guards + (self._guard("with", stmt.items[0].context_expr, "with {}"),)
            self.body(stmt.body, guards)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = stmt.args
            self.expr(stmt.decorator_list + args.defaults + [d for d in args.kw_defaults if d is not None], guards)
            annotations = [a.annotation for a in args.posonlyargs + args.args + args.kwonlyargs if a.annotation]
            annotations += [a.annotation for a in (args.vararg, args.kwarg) if a is not None and a.annotation]
            annotations += [stmt.returns] if stmt.returns else []
            if annotations:
                self.expr(annotations, self._annotation_guards(stmt, guards))
            self.body(stmt.body, guards)
        elif isinstance(stmt, ast.AnnAssign):
            self.expr(stmt.annotation, self._annotation_guards(stmt, guards))
            self.expr([stmt.target, stmt.value], guards)
        elif not hasattr(stmt, "body"):
            self.expr(stmt, guards)
        else:  # for, while, class, match
            for name in stmt._fields:
                value = getattr(stmt, name)
                if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                    self.body(value, guards)
                elif name == "cases":
                    for case in value:
                        self.expr([case.pattern, case.guard], guards)
                        self.body(case.body, guards)
                else:
                    self.expr(value, guards)

    def expr(self, node: Any, guards: Tuple[int, ...]) -> None:
        """Attribute chains on bound names in ``node`` (an AST node or a list of them)."""
        todo = list(node) if isinstance(node, list) else [node]
        bound, names = self.bound, self.scan.names
        while todo:
            item = todo.pop()
            kind = type(item)
            if kind is ast.Attribute:
                chain, base = [], item
                while type(base) is ast.Attribute:
                    chain.append(base.attr)
                    base = base.value
                if type(base) is ast.Name and base.id in bound:
                    chain.reverse()
                    if type(item.ctx) is not ast.Load:
                        chain.pop()  # `torch.x.y = v` sets y: only torch.x must exist
                    for i, part in enumerate(chain):
                        if part.startswith("__") and part.endswith("__"):
                            del chain[i:]  # __version__, __init__, ...: Python's, not torch's API
                            break
                    if chain:
                        names.append((".".join([bound[base.id]] + chain), item.lineno, guards))
                else:
                    todo.append(base)
                continue
            if kind is ast.IfExp and _is_guard_test(item.test):
                self.expr([item.test, item.body, item.orelse], guards + (self._guard("if", item.test, "if {}"),))
                continue
            if kind is ast.BoolOp and any(_is_guard_test(v) for v in item.values):
                self.expr(item.values, guards + (self._guard("if", item, "{}"),))
                continue
            for name in _CHILD_FIELDS.get(kind) or _child_fields(kind):
                value = getattr(item, name)
                if type(value) is list:
                    todo.extend(value)
                elif value is not None:
                    todo.append(value)


_LEAF_FIELDS = frozenset({"ctx", "id", "attr", "arg", "kind", "type_comment", "is_async", "level", "module", "name",
                          "asname", "conversion", "op", "ops", "names"})
_CHILD_FIELDS: Dict[type, Tuple[str, ...]] = {}


def _child_fields(kind: type) -> Tuple[str, ...]:
    """The fields of an AST node type that may hold nodes with attribute chains (none for leaves)."""
    if kind not in _CHILD_FIELDS:
        leaf = not issubclass(kind, ast.AST) or kind in (ast.Name, ast.Constant)
        _CHILD_FIELDS[kind] = () if leaf else tuple(f for f in kind._fields if f not in _LEAF_FIELDS)
    return _CHILD_FIELDS[kind]


def _stmt_lists(stmt: ast.stmt) -> Iterator[List[ast.stmt]]:
    for name in ("body", "orelse", "finalbody"):
        value = getattr(stmt, name, None)
        if isinstance(value, list):
            yield value
    for part in getattr(stmt, "handlers", None) or getattr(stmt, "cases", None) or ():
        yield part.body


def scan_file(path: str, shown: str) -> Optional[FileScan]:
    """The torch names one file uses, or None if it never mentions torch."""
    try:
        with open(path, "rb") as fh:
            source = fh.read()
    except OSError as exc:
        return FileScan(shown, error=f"cannot read: {exc.strerror or exc}")
    if b"torch" not in source:
        return None
    scan = FileScan(shown)
    try:
        tree = ast.parse(source, filename=shown)
    except (SyntaxError, ValueError) as exc:
        scan.error = f"{type(exc).__name__}: {getattr(exc, 'msg', None) or exc}"
        scan.error_line = getattr(exc, "lineno", 0) or 0
        return scan
    scanner = _Scanner(scan, source)
    scanner.prepare(tree)
    scanner.body(tree.body, ())
    return scan


def python_files(paths: Iterable[str]) -> Iterator[str]:
    """``.py`` files under each path (a file given by name is taken whatever its suffix). Hidden
    directories, ``__pycache__``, ``node_modules``, ``site-packages`` and virtual environments
    (a directory with ``pyvenv.cfg``) are skipped."""
    for path in paths:
        if not os.path.isdir(path):
            yield path
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                             and not os.path.exists(os.path.join(root, d, "pyvenv.cfg")))
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.join(root, name)


def _shown(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith(os.pardir) else rel


# -- the report ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def not_backportable() -> List[Dict[str, str]]:
    data = json.loads((_catalogue_dir() / "not_backportable.json").read_text())
    return list(data["entries"])


def not_backportable_for(name: str) -> Optional[Dict[str, str]]:
    for entry in not_backportable():
        if name == entry["name"] or name.startswith(entry["name"] + "."):
            return entry
    return None


@dataclass
class Target:
    version: str  # the release checked against
    installed: Optional[str]
    source: str  # words: where what exists comes from
    view: Any


def choose_target(requested: Optional[str], live: bool) -> Target:
    """The torch to check against; ValueError with the reason if there is none."""
    installed = _versions.torch_version()
    inventories = inventory_files()
    base = ".".join(map(str, _versions.release(installed) or ())) if installed else None
    version = base
    if requested:
        wanted = _versions.release(requested)
        matching = [v for v in inventories if wanted and (_versions.release(v) or ())[:len(wanted)] == wanted]
        if base and wanted and (_versions.release(base) or ())[:len(wanted)] == wanted:
            version = base
        elif len(matching) == 1:
            version = matching[0]
        else:
            raise ValueError(f"torch {requested} is {'ambiguous' if matching else 'neither installed nor inventoried'}: "
                             f"installed {installed or 'none'}; inventoried {', '.join(inventories)}")
    elif not installed:
        raise ValueError(f"torch is not installed here: pass --torch VERSION (inventoried: {', '.join(inventories)})")
    assert version is not None
    others = [Inventory.load(p) for p in inventories.values()]
    inv_view = InventoryView(Inventory.load(inventories[version]), others) if version in inventories else None
    if version != base:
        assert inv_view is not None
        return Target(version, installed, f"torch {version} from its inventory (not installed)", inv_view)
    if not live:
        view = inv_view or InventoryView(Inventory({"torch": version, "modules": {}, "failing": {}}), others)
        return Target(version, installed, f"installed torch {installed}, {'from its inventory' if inv_view else 'no inventory'}"
                      " (--no-import)", view)
    if inv_view is not None:
        return Target(version, installed, f"installed torch {installed}, from its inventory and a live import where needed",
                      LayeredView(inv_view, LiveView()))
    return Target(version, installed, f"installed torch {installed}, by importing it (no inventory of {version})", LiveView())


@functools.lru_cache(maxsize=None)
def _native_resolvers() -> Tuple[Tuple[str, Resolver], ...]:
    inventories = [Inventory.load(p) for p in inventory_files().values()]
    return tuple((inv.version, Resolver(InventoryView(inv, inventories), inv.version)) for inv in inventories)


def _row_key(name: str, result: Result) -> Tuple[str, str]:
    """The name a row is about, and its note. A missing or undecided name is cut where a torch
    that has it says its attributes end (``DeviceMesh.from_group``: at ``DeviceMesh``), or else
    after its first missing or undecided part."""
    if result.status not in (MISSING, UNKNOWN):
        return result.key, result.note
    for _version, resolver in reversed(_native_resolvers()):
        found = resolver.resolve(name)
        if found.status == NATIVE:
            note = f"{result.key} is missing" if found.key != result.key and result.status == MISSING else ""
            return found.key, "; ".join(n for n in (note, result.note) if n)
    return result.key, result.note


def exists_in(name: str) -> List[str]:
    """The inventoried torch versions that have ``name`` natively."""
    return [version for version, resolver in _native_resolvers() if resolver.resolve(name).status == NATIVE]


def check(paths: Sequence[str], target: Target, patches: Optional[Sequence[Patch]] = None,
          cfg: Optional[Config] = None) -> Dict[str, Any]:
    """Scan ``paths`` and resolve every torch name on ``target``: the report as a dict."""
    cfg = cfg or Config.from_environ()
    files = list(python_files(paths))
    collecting = gc.isenabled()
    gc.disable()  # parsing allocates millions of AST nodes and makes no cycles: collections only cost time
    try:
        scans = [s for s in (scan_file(p, _shown(p)) for p in files) if s is not None]
    finally:
        if collecting:
            gc.enable()
    serving = Serving.for_torch(target.version, all_patches() if patches is None else patches, cfg)
    resolver = Resolver(target.view, target.version, serving)
    try:
        rows = _rows(scans, resolver)
    finally:
        target.view.close()
    counts = {kind: sum(1 for r in rows if r["kind"] == kind) for kind in KINDS}
    return {
        "torch": target.version,
        "installed": target.installed,
        "source": target.source,
        "files": len(files),
        "files_with_torch": sum(1 for s in scans if not s.error),
        "skipped": [{"file": s.path, "line": s.error_line, "error": s.error} for s in scans if s.error],
        "rows": rows,
        "counts": counts,
        "exit": 1 if counts[UNRESOLVED] else 0,
    }


def _rows(scans: Sequence[FileScan], resolver: Resolver) -> List[Dict[str, Any]]:
    results: Dict[str, Result] = {}
    keys: Dict[str, Tuple[str, str]] = {}  # name -> (row name, note)
    places: Dict[str, List[Tuple[int, int, Tuple[int, ...]]]] = {}  # row name -> (file index, line, guards)
    try_names: Dict[Tuple[int, int], List[str]] = {}  # (file index, "try" guard) -> names in its body
    for f, scan in enumerate(scans):
        for name, line, guards in scan.names:
            if name not in results:
                results[name] = resolver.resolve(name)
                keys[name] = _row_key(name, results[name])
            places.setdefault(keys[name][0], []).append((f, line, guards))
            for g in guards:
                if scan.guards[g].kind == "try":
                    try_names.setdefault((f, g), []).append(name)
    by_key = {keys[name][0]: (result, keys[name][1]) for name, result in results.items()}

    def effective(f: int, g: int) -> bool:
        guard = scans[f].guards[g]
        if guard.kind != "fallback":
            return True  # an except branch is guarded only while what it stands in for resolves
        tried = try_names.get((f, guard.partner), [])
        return bool(tried) and all(results[n].status != MISSING for n in tried)

    rows = []
    for key, where in places.items():
        result, note = by_key[key]
        guarded_by: List[str] = []
        unguarded = False
        for f, _line, guards in where:
            active = [scans[f].guards[g].text for g in guards if effective(f, g)]
            unguarded |= not active
            guarded_by += [a for a in active if a not in guarded_by]
        kind = result.status if result.status != MISSING else UNRESOLVED if unguarded else GUARDED
        row: Dict[str, Any] = {
            "name": key,
            "kind": kind,
            "patches": list(result.patches),
            "how": list(result.how),
            "note": note,
            "guarded": not unguarded,
            "guards": guarded_by[:5],
            "locations": [{"file": scans[f].path, "line": line} for f, line, _g in
                          sorted(where, key=lambda p: (scans[p[0]].path, p[1]))],
        }
        if kind in (UNRESOLVED, GUARDED, UNKNOWN):
            row["exists_in"] = exists_in(key)
            row["not_backportable"] = not_backportable_for(key)
        rows.append(row)
    order = {k: i for i, k in enumerate(KINDS)}
    rows.sort(key=lambda r: (order[r["kind"]], r["name"]))
    return rows


def format_text(report: Dict[str, Any]) -> str:
    """The report for people: one line per name, problems first."""
    rows = report["rows"]
    lines = [f"torchpatch check: {report['files']} files ({report['files_with_torch']} use torch), "
             f"{len(rows)} torch names, against {report['source']}"]
    width = max([len(r["name"]) for r in rows] + [20])
    for r in rows:
        first = r["locations"][0]
        where = f"{first['file']}:{first['line']}" + (f" (+{len(r['locations']) - 1})" if len(r["locations"]) > 1 else "")
        lines.append(f"  {r['kind']:<10} {r['name']:<{width}}  {where}")
        details = []
        if r["patches"]:
            details.append("; ".join(r["how"]))
        if r["kind"] == GUARDED or (r["guarded"] and r["kind"] == UNKNOWN):
            details.append("guarded by " + "; ".join(r["guards"]))
        if r["note"]:
            details.append(r["note"])
        if r.get("exists_in"):
            details.append("inventoried torch versions that have it: " + ", ".join(r["exists_in"]))
        elif r["kind"] != UNKNOWN and "exists_in" in r:
            details.append("no inventoried torch version has it")
        nb = r.get("not_backportable")
        if nb:
            details.append(f"not backportable: {nb['what']}, torch {nb['torch']} ({nb['why']})")
        lines += [f"  {'':<10} {d}" for d in details]
    for s in report["skipped"]:
        lines.append(f"  skipped    {s['file']}:{s['line']}: {s['error']}")
    counts = report["counts"]
    summary = ", ".join(f"{counts[k]} {k}" for k in KINDS)
    if counts[PATCHED]:
        summary += " (patched names need TORCHPATCH=1 at run time)"
    lines.append(f"{summary}; exit {report['exit']}")
    return "\n".join(lines)
