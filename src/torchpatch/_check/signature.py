"""Call signatures as the inventories record them (``"(self, a, b=None, *, c=...)"``, annotations
dropped) and the check of one call's arguments against one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence, Tuple

_OPEN, _CLOSE = "([{<", ")]}>"


def param_name(param: str) -> str:
    """The name of a parameter as a signature writes it (``"name=default"``, ``"name"``)."""
    return param.split("=", 1)[0].strip()


@dataclass(frozen=True)
class CallShape:
    """The arguments of one call, as the source shows them."""

    positional: int
    keywords: Tuple[str, ...]
    star: bool = False  # a ``*args`` among them: how many positionals is not known
    starstar: bool = False  # a ``**kwargs``: which keywords is not known


def _split(params: str) -> List[str]:
    """Top-level comma-separated parts, brackets and quotes respected (defaults are reprs)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(params):
        if quote:
            quote = "" if ch == quote and params[i - 1] != "\\" else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            parts.append(params[start:i].strip())
            start = i + 1
    parts.append(params[start:].strip())
    return [p for p in parts if p]


@dataclass(frozen=True)
class Signature:
    """An ``__init__``'s parameters, ``self`` left out."""

    text: str
    positional: Tuple[str, ...]  # what may be passed by position, in order
    keyword: FrozenSet[str]  # what may be passed by keyword
    required: FrozenSet[str]  # what has no default
    varargs: bool
    varkw: bool

    @classmethod
    def parse(cls, text: str) -> Optional["Signature"]:
        inner = text.strip()
        if not (inner.startswith("(") and inner.endswith(")")):
            return None
        positional: List[str] = []
        keyword: List[str] = []
        required: List[str] = []
        varargs = varkw = kwonly = False
        for part in _split(inner[1:-1]):
            if part == "/":
                keyword = [k for k in keyword if k not in positional]
            elif part == "*":
                kwonly = True
            elif part.startswith("**"):
                varkw = True
            elif part.startswith("*"):
                varargs = kwonly = True
            else:
                name, has_default = param_name(part), "=" in part
                if not kwonly:
                    positional.append(name)
                keyword.append(name)
                if not has_default:
                    required.append(name)
        if not positional:
            return None  # not a method's signature: no self
        self_name = positional.pop(0)
        return cls(text, tuple(positional), frozenset(keyword) - {self_name}, frozenset(required) - {self_name},
                   varargs, varkw)

    def widened(self, params: Sequence[str]) -> "Signature":
        """This signature where each ``"name=default"`` of ``params`` is optional: made so where it is a
        parameter, added as a keyword-only one where it is not (a patch's additions, ``Patch.takes``)."""
        names = [param_name(p) for p in params]
        added = [p for p, name in zip(params, names) if name not in self.keyword and name not in self.positional]
        text = self.text if not added else f"{self.text[:-1]}, *, {', '.join(added)})".replace("(, ", "(")
        return Signature(text, self.positional, self.keyword.union(names), self.required.difference(names),
                         self.varargs, self.varkw)

    @property
    def names(self) -> FrozenSet[str]:
        """Every named parameter (an instance usually keeps them as attributes)."""
        return self.keyword.union(self.positional)

    def problems(self, call: CallShape) -> List[str]:
        """What makes ``call`` fail against this signature (TypeError at run time); empty if nothing."""
        found = []
        if not call.star and not self.varargs and call.positional > len(self.positional):
            found.append(f"{call.positional} positional arguments, at most {len(self.positional)}")
        unknown = [k for k in call.keywords if k not in self.keyword]
        if unknown and not self.varkw:
            found.append("unexpected keyword argument " + ", ".join(repr(k) for k in unknown))
        if not call.star and not call.starstar:
            given = set(self.positional[:call.positional]).union(call.keywords)
            missing = [p for p in self.positional + tuple(sorted(self.keyword - set(self.positional)))
                       if p in self.required and p not in given]
            if missing:
                found.append("missing required argument " + ", ".join(repr(m) for m in missing))
        return found
