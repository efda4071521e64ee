"""Import guards: what code tests before it uses a name that may be missing (``try``/``except
ImportError``, ``contextlib.suppress``, an ``if`` on ``hasattr``/``getattr``/``find_spec`` or on a
version), recognised in the AST."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import List

IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception", "BaseException"}
GUARD_CALLS = {"hasattr", "getattr", "find_spec", "find_loader"}
GUARD_WORDS = re.compile(r"version|type_checking|greater|newer|older|at_?least|less_than|(?:^|_)(?:ge|gt|le|lt)(?:_|\d|$)",
                         re.IGNORECASE)
TRY = (ast.Try, ast.TryStar) if hasattr(ast, "TryStar") else (ast.Try,)


@dataclass
class Guard:
    kind: str  # "try" | "fallback" (an except branch of a "try") | "if" | "with" | "annotation"
    text: str
    partner: int = -1  # for a fallback: the index of its "try" guard


def dotted(node: ast.AST) -> str:
    """``a.b.c`` for a chain of attributes on a name, else ""."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def exception_names(handler: ast.ExceptHandler) -> List[str]:
    """The (last parts of the) exception names an ``except`` clause catches."""
    if handler.type is None:
        return []
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return [dotted(t).rsplit(".", 1)[-1] for t in types]


def catches_import_errors(handler: ast.ExceptHandler) -> bool:
    return handler.type is None or any(n in IMPORT_ERRORS for n in exception_names(handler))


def is_guard_test(node: ast.AST) -> bool:
    """Whether an ``if`` test (or a boolean operand) looks at what torch has."""
    for sub in ast.walk(node):
        ident = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
        if ident is not None and (ident in GUARD_CALLS or GUARD_WORDS.search(ident)):
            return True
    return False


def suppresses_import_errors(item: ast.withitem) -> bool:
    """``with contextlib.suppress(ImportError, ...)`` (or ``suppress(...)``)."""
    call = item.context_expr
    return (isinstance(call, ast.Call) and dotted(call.func).rsplit(".", 1)[-1] == "suppress"
            and any(dotted(a).rsplit(".", 1)[-1] in IMPORT_ERRORS for a in call.args))
