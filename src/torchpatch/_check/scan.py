"""The static scan of source files: the torch names each file uses (imports, attribute chains on
imported torch names, ``torch.ops.<ns>.<op>``), the members it uses on values whose torch class the
code makes evident, and the calls of torch classes, each with the import guards around it.

Speed matters (a repository has thousands of files): a first pass finds the names torch imports
bind and the lines where they (or values typed from them) appear, and the second pass visits only
the statements that touch those lines. The torch class of a value is inferred simply, per function
(or module) scope in source order: a name bound by a call of a torch class or factory, an index or
attribute of such a value (see :mod:`.factories`), an annotation, or an ``isinstance`` test (in its
``if`` branch). Class attributes (``self.mesh``) and values passed around are not followed.
"""

from __future__ import annotations

import ast
import bisect
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from .base import ROOT
from .factories import FUNCTIONS
from .guards import (TRY, Guard, catches_import_errors, dotted, exception_names, is_guard_test,
                     suppresses_import_errors)
from .members import TypeExpr
from .signature import CallShape

SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}
MAX_FILE_BYTES = 10 * 1024 * 1024  # a larger "source" file is data or generated: skipped, and said so


@dataclass
class FileScan:
    path: str
    names: List[Tuple[str, int, Tuple[int, ...]]] = field(default_factory=list)  # (name, line, guards)
    members: List[Tuple[TypeExpr, str, int, Tuple[int, ...]]] = field(default_factory=list)  # (receiver, member, ...)
    calls: List[Tuple[TypeExpr, CallShape, int, Tuple[int, ...]]] = field(default_factory=list)  # (callee, args, ...)
    guards: List[Guard] = field(default_factory=list)
    error: str = ""
    error_line: int = 0


_NEWLINE = re.compile(rb"\n")
_WORD = re.compile(rb"\w")


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


def _occurrences(source: bytes, word: bytes, start: int = 0, end: int = -1, then: bytes = b"") -> List[int]:
    """Offsets of ``word`` as a whole identifier in ``source[start:end]`` (followed by ``then``)."""
    found, end = [], len(source) if end < 0 else end
    needle = word + then
    at = source.find(needle, start, end)
    while at != -1:
        if at == 0 or not _WORD.match(source, at - 1):
            if then or not _WORD.match(source, at + len(word)):
                found.append(at)
        at = source.find(needle, at + 1, end)
    return found


def _lines(source: bytes, offsets: List[int]) -> List[int]:
    """The (1-based) line numbers of byte ``offsets`` in ``source``."""
    lines, line, previous = [], 1, 0
    for at in sorted(offsets):
        line += source.count(b"\n", previous, at)
        previous = at
        lines.append(line)
    return lines


def _is_torch(module: Optional[str]) -> bool:
    return bool(module) and (module == ROOT or module.startswith(ROOT + "."))  # type: ignore[union-attr]


def _stmt_lists(stmt: ast.stmt) -> Iterator[List[ast.stmt]]:
    for name in ("body", "orelse", "finalbody"):
        value = getattr(stmt, name, None)
        if isinstance(value, list):
            yield value
    for part in getattr(stmt, "handlers", None) or getattr(stmt, "cases", None) or ():
        yield part.body


def _assigned(target: ast.expr) -> Iterator[ast.Name]:
    """The names an assignment to ``target`` binds."""
    if isinstance(target, ast.Name):
        yield target
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _assigned(element)
    elif isinstance(target, ast.Starred):
        yield from _assigned(target.value)


def _call_shape(call: ast.Call) -> CallShape:
    star = any(isinstance(a, ast.Starred) for a in call.args)
    return CallShape(sum(1 for a in call.args if not isinstance(a, ast.Starred)),
                     tuple(k.arg for k in call.keywords if k.arg is not None), star,
                     any(k.arg is None for k in call.keywords))


class _Scanner:
    """One file: its torch imports, the attribute chains on the names they bind, and the members
    used on values of torch classes."""

    def __init__(self, scan: FileScan, source: bytes, classes: FrozenSet[str] = frozenset()) -> None:
        self.scan, self.source = scan, source
        self.typing = classes.union(FUNCTIONS)  # names worth following: torch classes with members, factories
        self.bound: Dict[str, str] = {}  # local name -> torch dotted name
        self.typed: Dict[str, TypeExpr] = {}  # local name -> its type expression, in the current scope
        self.scope: Tuple[int, int] = (1, 1)  # the lines of the current scope (for typed names' uses)
        self.lazy_annotations = False
        self.flagged: List[int] = []  # lines with a torch import or a bound name followed by a dot
        self.starts: List[int] = []  # byte offset of each line, made when needed

    # pass 1: the names torch imports bind; the lines worth a look
    def prepare(self, tree: ast.Module) -> None:
        source = self.source
        self.flagged = _lines(source, _torch_imports(source))
        self.lazy_annotations = any(isinstance(s, ast.ImportFrom) and s.module == "__future__"
                                    and any(a.name == "annotations" for a in s.names) for s in tree.body)
        self.bindings(tree.body)
        uses = []
        for name, full in self.bound.items():  # `name.`; a chain broken across lines before its first dot is not flagged
            typing = full.rsplit(".", 1)[-1] in self.typing  # a class or factory: its calls, annotations, tests too
            uses += _occurrences(source, name.encode(), then=b"" if typing else b".")
        self.flagged = sorted(set(self.flagged).union(_lines(source, uses)))
        self.scope = (1, source.count(b"\n") + 1)

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

    def _offset(self, line: int, col: int = 0) -> int:
        if not self.starts:
            self.starts = [0] + [m.end() for m in _NEWLINE.finditer(self.source)]
        return self.starts[line - 1] + col if line <= len(self.starts) else len(self.source)

    def _worth(self, expr: TypeExpr) -> bool:
        """Whether ``expr`` may be a value of a class whose members are known (or a factory's)."""
        while expr[0] not in ("name", "inst"):
            expr = expr[1]
        return any(part in self.typing for part in expr[1].split("."))

    def _type(self, name: str, expr: Optional[TypeExpr], lines: Tuple[int, int]) -> None:
        """Bind (or, with None, unbind) a typed local; flag its uses on ``lines`` when bound."""
        if expr is None or not self._worth(expr):
            self.typed.pop(name, None)
            return
        self.typed[name] = expr
        start, end = self._offset(lines[0]), self._offset(lines[1] + 1)
        found = _lines(self.source, _occurrences(self.source, name.encode(), start, end))
        if found:
            self.flagged = sorted(set(self.flagged).union(found))

    def _guard(self, kind: str, node: ast.AST, what: str, partner: int = -1) -> int:
        """A new guard; ``{}`` in ``what`` becomes the source of ``node``."""
        if "{}" in what:  # offsets are in bytes of the UTF-8 source
            start = self._offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
            end = self._offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
            segment = " ".join(self.source[start:end].decode("utf-8", "replace").split())
            what = what.format(segment if len(segment) <= 60 else segment[:57] + "...")
        self.scan.guards.append(Guard(kind, f"{what} ({self.scan.path}:{getattr(node, 'lineno', 0)})", partner))
        return len(self.scan.guards) - 1

    def _annotation_guards(self, node: ast.AST, guards: Tuple[int, ...]) -> Tuple[int, ...]:
        if not self.lazy_annotations:
            return guards
        return guards + (self._guard("annotation", node, "annotation, not evaluated (from __future__ import annotations)"),)

    # type expressions
    def type_of(self, node: ast.AST) -> Optional[TypeExpr]:
        """The type expression of a value: a torch name, or what is made from one (or None)."""
        kind = type(node)
        if kind is ast.Name:
            found = self.typed.get(node.id)  # type: ignore[attr-defined]
            if found is None and node.id in self.bound:  # type: ignore[attr-defined]
                found = ("name", self.bound[node.id])  # type: ignore[attr-defined]
            return found
        if kind is ast.Attribute:
            inner = self.type_of(node.value)  # type: ignore[attr-defined]
            if inner is None:
                return None
            return ("name", f"{inner[1]}.{node.attr}") if inner[0] == "name" else ("attr", inner, node.attr)  # type: ignore[attr-defined]
        if kind is ast.Call or kind is ast.Subscript:
            inner = self.type_of(node.func if kind is ast.Call else node.value)  # type: ignore[attr-defined]
            return None if inner is None else ("call" if kind is ast.Call else "item", inner)
        return None

    def annotation_type(self, node: Optional[ast.AST]) -> Optional[TypeExpr]:
        """The type an annotation names: ``C``, ``Optional[C]``, ``C | None``, ``"C"``."""
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                return self.annotation_type(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return None
        if isinstance(node, ast.Subscript) and dotted(node.value).rsplit(".", 1)[-1] == "Optional":
            inner = getattr(node.slice, "value", None) if sys.version_info < (3, 9) else node.slice  # 3.8: ast.Index
            return self.annotation_type(inner)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            sides = [s for s in (node.left, node.right) if not (isinstance(s, ast.Constant) and s.value is None)]
            return self.annotation_type(sides[0]) if len(sides) == 1 else None
        found = self.type_of(node)
        return ("inst", found[1]) if found and found[0] == "name" else None

    def _isinstance(self, test: ast.AST) -> Optional[Tuple[str, TypeExpr]]:
        """``isinstance(x, C)`` with C a torch name: (x, an instance of C)."""
        if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance"
                and len(test.args) == 2 and isinstance(test.args[0], ast.Name)):
            found = self.type_of(test.args[1])
            if found and found[0] == "name":
                return test.args[0].id, ("inst", found[1])
        return None

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
            module = stmt.module or ""
            if not stmt.level and _is_torch(module):
                names += [(module if a.name == "*" else f"{module}.{a.name}", stmt.lineno, guards) for a in stmt.names]
        elif isinstance(stmt, ast.Assign):
            self.expr(stmt, guards)
            value = self.type_of(stmt.value)
            for target in stmt.targets:
                for assigned in _assigned(target):
                    self._type(assigned.id, value if target is assigned else None, self.scope)
        elif isinstance(stmt, ast.If):
            if is_guard_test(stmt.test):
                guards = guards + (self._guard("if", stmt.test, "if {}"),)
            self.expr(stmt.test, guards)
            narrowed = self._isinstance(stmt.test)
            if narrowed and stmt.body:
                before = self.typed.get(narrowed[0])
                self._type(narrowed[0], narrowed[1], (stmt.body[0].lineno, stmt.body[-1].end_lineno or stmt.lineno))
                self.body(stmt.body, guards)
                self._type(narrowed[0], before, self.scope)
            else:
                self.body(stmt.body, guards)
            self.body(stmt.orelse, guards)
        elif isinstance(stmt, TRY):
            catching = [h for h in stmt.handlers if catches_import_errors(h)]
            inner = fallback = guards
            if catching:
                caught = "/".join(sorted({n for h in catching for n in exception_names(h)})) or "(bare)"
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
            if any(suppresses_import_errors(item) for item in stmt.items):
                guards = guards + (self._guard("with", stmt.items[0].context_expr, "with {}"),)
            self.body(stmt.body, guards)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.function(stmt, guards)
        elif isinstance(stmt, ast.AnnAssign):
            self.expr(stmt.annotation, self._annotation_guards(stmt, guards))
            self.expr([stmt.target, stmt.value], guards)
            if isinstance(stmt.target, ast.Name):
                found = self.annotation_type(stmt.annotation) or (self.type_of(stmt.value) if stmt.value else None)
                self._type(stmt.target.id, found, self.scope)
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

    def function(self, stmt: Union[ast.FunctionDef, ast.AsyncFunctionDef], guards: Tuple[int, ...]) -> None:
        """A function: its decorators, defaults and annotations, then its body as a scope of its own
        (the enclosing scope's typed names stay visible until rebound)."""
        args = stmt.args
        self.expr(stmt.decorator_list + args.defaults + [d for d in args.kw_defaults if d is not None], guards)
        params = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
        annotations = [a.annotation for a in params if a.annotation] + ([stmt.returns] if stmt.returns else [])
        if annotations:
            self.expr(annotations, self._annotation_guards(stmt, guards))
        saved = self.typed, self.scope
        self.typed, self.scope = dict(self.typed), (stmt.lineno, stmt.end_lineno or stmt.lineno)
        for arg in params:
            typed = arg not in (args.vararg, args.kwarg)
            self._type(arg.arg, self.annotation_type(arg.annotation) if typed else None, self.scope)
        self.body(stmt.body, guards)
        self.typed, self.scope = saved

    def expr(self, node: Any, guards: Tuple[int, ...]) -> None:
        """Attribute chains on bound names, members used on typed values and calls of torch
        classes in ``node`` (an AST node or a list of them)."""
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
                if type(base) is ast.Name and base.id in bound and base.id not in self.typed:
                    chain.reverse()
                    if type(item.ctx) is not ast.Load:
                        chain.pop()  # `torch.x.y = v` sets y: only torch.x must exist
                    for i, part in enumerate(chain):
                        if part.startswith("__") and part.endswith("__"):
                            del chain[i:]  # __version__, __init__, ...: Python's, not torch's API
                            break
                    if chain:
                        names.append((".".join([bound[base.id]] + chain), item.lineno, guards))
                    continue
                member = chain[-1]
                if (type(item.ctx) is ast.Load or len(chain) > 1) and not member.startswith("__"):
                    receiver = self.type_of(base)
                    if receiver is not None and self._worth(receiver):
                        self.scan.members.append((receiver, member, item.lineno, guards))
                todo.append(base)
                continue
            if kind is ast.Call:
                callee = self.type_of(item.func)
                if callee is not None and callee[0] == "name" and callee[1].rsplit(".", 1)[-1] in self.typing:
                    self.scan.calls.append((callee, _call_shape(item), item.lineno, guards))
            elif kind is ast.IfExp and is_guard_test(item.test):
                self.expr([item.test, item.body, item.orelse], guards + (self._guard("if", item.test, "if {}"),))
                continue
            elif kind is ast.BoolOp and any(is_guard_test(v) for v in item.values):
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
        _CHILD_FIELDS[kind] = () if leaf else tuple(f for f in kind._fields if f not in _LEAF_FIELDS)  # type: ignore[attr-defined]
    return _CHILD_FIELDS[kind]


def _not_regular(mode: int) -> str:
    """Why a file of this ``st_mode`` is not read ("" for a regular file)."""
    if stat.S_ISREG(mode):
        return ""
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
    return f"not a regular file ({next((kind for test, kind in kinds if test(mode)), 'unknown kind')})"


def _too_large(size: int) -> str:
    return f"too large ({size} bytes; files over {MAX_FILE_BYTES} are not scanned)" if size > MAX_FILE_BYTES else ""


def read_source(path: str) -> Tuple[Optional[bytes], str]:
    """A file's bytes, or None and why it is skipped. Only a regular file (a link followed) of at most
    MAX_FILE_BYTES is read: a FIFO or a device named ``*.py`` (a link to ``/dev/zero``) would block
    or never end. Nothing else is opened, and the opening never blocks (a FIFO put in the file's
    place after the stat is seen on the open file)."""
    source = b""
    try:
        why = _not_regular(os.stat(path).st_mode)
        if not why:
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY), "rb") as fh:
                info = os.fstat(fh.fileno())
                why = _not_regular(info.st_mode) or _too_large(info.st_size)
                source = b"" if why else fh.read(MAX_FILE_BYTES + 1)
            why = why or _too_large(len(source))  # it grew since
    except OSError as exc:
        return None, f"cannot read: {exc.strerror or exc}"
    return (None, why) if why else (source, "")


def scan_file(path: str, shown: str, classes: FrozenSet[str] = frozenset()) -> Optional[FileScan]:
    """The torch names one file uses, or None if it never mentions torch. ``classes``: the names of
    the torch classes whose members are known (values of other classes are not followed)."""
    source, why = read_source(path)
    if source is None:
        return FileScan(shown, error=why)
    if b"torch" not in source:
        return None
    scan = FileScan(shown)
    try:
        tree = ast.parse(source, filename=shown)
    except (SyntaxError, ValueError) as exc:
        scan.error = f"{type(exc).__name__}: {getattr(exc, 'msg', None) or exc}"
        scan.error_line = getattr(exc, "lineno", 0) or 0
        return scan
    scanner = _Scanner(scan, source, classes)
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


def shown(path: str) -> str:
    """``path`` as a report shows it: relative to the working directory where it is under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith(os.pardir) else rel
