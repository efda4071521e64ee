"""Members, not only names: the torch class of a value the code makes or names (the scanner's type
expressions, evaluated on an inventory), and the members and constructor calls used on it.

A type expression (made by :mod:`.scan`) is a tuple:

- ``("name", dotted)``: the object a torch name is (a class, a function, a class's member);
- ``("inst", dotted)``: an instance of the class a torch name is (an annotation, ``isinstance``);
- ``("call", E)``, ``("item", E)``, ``("attr", E, name)``: calling, indexing, an attribute of ``E``.

Only inventories that record classes (``classes``) know members; elsewhere nothing is checked.
Only torch.distributed's own classes are followed (``FOLLOWED``): ``torch.Tensor`` or ``nn.Module``
values, everywhere in training code, are not (their members count for the classes that extend them).
Inventories record class-level members only (``dir(cls)``): instance attributes and a metaclass's
attributes are not there. So a parameter of ``__init__`` counts as a member (an instance keeps it),
and a member the target's class lacks is a gap only where a newer inventoried torch's class has it
(an addition); one that only older torches list is not reported, as it has usually moved to the
instance or the metaclass (``dist.group.WORLD`` since 2.0) rather than gone.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .. import _versions
from .base import MISSING, NATIVE, PATCHED, Result
from .factories import RETURNS
from .inventory import Inventory
from .serving import Serving
from .signature import CallShape, Signature, param_name

TypeExpr = Tuple[Any, ...]  # ("name" | "inst", dotted) | ("call" | "item", TypeExpr) | ("attr", TypeExpr, name)
FOLLOWED = ("torch.distributed.", "torch._C._distributed")  # where the classes whose members are checked live
# ("class" | "instance" | "object" (a function, or a class without members recorded) | "member",
#  its key "module:qualname", the member's name)
Value = Tuple[str, str, str]


class Types:
    """Evaluates type expressions on one inventory; ``aliases`` are modules served as others."""

    def __init__(self, inv: Inventory, aliases: Optional[Mapping[str, str]] = None) -> None:
        self.inv = inv
        self.aliases = aliases or {}
        self._memo: Dict[TypeExpr, Optional[Value]] = {}
        self._signatures: Dict[str, Optional[Signature]] = {}

    def value(self, expr: TypeExpr) -> Optional[Value]:
        if not self.inv.classes:
            return None
        if expr not in self._memo:
            self._memo[expr] = self._value(expr)
        return self._memo[expr]

    def cls(self, expr: TypeExpr) -> Optional[str]:
        """The class key of what ``expr`` is an instance of, or is."""
        found = self.value(expr)
        return found[1] if found and found[0] in ("class", "instance") else None

    def has(self, key: str, member: str) -> bool:
        sig = self.signature(key)
        return member in self.inv.members(key) or (sig is not None and member in sig.names)

    def signature(self, key: str) -> Optional[Signature]:
        if key not in self._signatures:
            text = self.inv.classes[key].get("init")
            self._signatures[key] = Signature.parse(text) if text else None
        return self._signatures[key]

    def _value(self, expr: TypeExpr) -> Optional[Value]:
        op = expr[0]
        if op == "name":
            return self._name(expr[1])
        if op == "inst":
            found = self._name(expr[1])
            return ("instance", found[1], "") if found and found[0] == "class" else None
        inner = self.value(expr[1])
        if inner is None:
            return None
        kind, key, member = inner
        if op == "call":
            if kind == "class":
                return "instance", key, ""
            return self._returns(key, f".{member}()" if kind == "member" else "()") if kind != "instance" else None
        if kind != "instance":
            return None
        if op == "item":
            return self._returns(key, "[]")
        return self._returns(key, f".{expr[2]}") or ("member", key, expr[2])  # "attr"

    def _name(self, dotted: str) -> Optional[Value]:
        parts = dotted.split(".")
        real, shown, i = parts[0], parts[0], 1
        while i < len(parts):
            module = self._module(f"{real}.{parts[i]}") or self._module(f"{shown}.{parts[i]}")
            if module is None:
                break
            real, shown, i = module, f"{shown}.{parts[i]}", i + 1
        if i == len(parts) or real not in self.inv.modules:
            return None
        key = self.inv.modules[real].get(parts[i], "")
        if ":" not in key:
            return None
        rest = parts[i + 1:]
        if not followed(key, self.inv):
            return ("object", key, "") if not rest else None
        if not rest:
            return "class", key, ""
        return ("member", key, rest[0]) if len(rest) == 1 else None

    def _module(self, name: str, depth: int = 0) -> Optional[str]:
        if name in self.inv.modules:
            return name
        target = self.aliases.get(name)
        return self._module(target, depth + 1) if target and depth < 8 else None

    def _returns(self, key: str, how: str) -> Optional[Value]:
        module, qualname = key.split(":", 1)
        name = RETURNS.get(qualname + how)
        if name is None:
            return None
        found = self.inv.modules.get(module, {}).get(name, "")
        if found not in self.inv.classes:
            named = [k for k in self.inv.classes if k.rsplit(":", 1)[1] == name]
            found = named[0] if len(named) == 1 else ""
        return ("instance", found, "") if followed(found, self.inv) else None


def followed(key: str, inv: Inventory) -> bool:
    """Whether values of class ``key`` are followed: one of torch.distributed's, with members recorded."""
    return key.startswith(FOLLOWED) and key in inv.classes


def _owner(expr: TypeExpr, key: str) -> str:
    """The class as a row names it: as the code names it (``dist.ReduceOp.SUM``, ``PipelineStage(...)``),
    or for a value of the class, where the class is defined (one row, however the value was made)."""
    return expr[1] if expr[0] == "name" else key.replace(":", ".")


class MemberChecker:
    """Members used on torch values, and constructor calls, checked on one inventoried torch."""

    def __init__(self, inv: Inventory, others: Sequence[Inventory], serving: Serving) -> None:
        self.types = Types(inv, serving.alias_targets())
        self.others = [Types(o) for o in others if o is not inv]
        self.serving = serving

    def member(self, receiver: TypeExpr, member: str) -> Optional[Result]:
        """The row for ``receiver.member``, or None where it cannot be checked."""
        key = self.types.cls(receiver)
        if key is None:
            return None
        name = f"{_owner(receiver, key)}.{member}"
        if self.types.has(key, member):
            return Result(NATIVE, name)
        named = [receiver[1]] if receiver[0] in ("name", "inst") else []
        owners = list(dict.fromkeys(named + [key.replace(":", ".")]))  # a patch declares it on either
        for owner in owners:
            patch = self.serving.symbols.get((owner, member))
            if patch:
                return Result(PATCHED, name, (patch,), (f"{owner}.{member} served by {patch}",))
        mine = _versions.release(self.types.inv.version) or ()
        if not any((_versions.release(v) or ()) > mine for v in self.exists_in(receiver, member)):
            return None  # no newer torch's class has it: an instance attribute, or nothing to say
        off = [self.serving.off[f"{o}.{member}"] for o in owners if f"{o}.{member}" in self.serving.off]
        return Result(MISSING, name, note=off[0] if off else "")

    def exists_in(self, receiver: TypeExpr, member: str) -> List[str]:
        """The other inventoried torch versions whose class of ``receiver`` has ``member``."""
        found = []
        for types in self.others:
            key = types.cls(receiver)
            if key is not None and types.has(key, member):
                found.append(types.inv.version)
        return found

    def call(self, callee: TypeExpr, shape: CallShape) -> Optional[Result]:
        """The row for a call of a torch class whose ``__init__`` rejects its arguments, else None; where
        the parameters the catalogue's patches add (``Patch.takes``) make the call work, a patched row."""
        found = self.types.value(callee)
        if found is None or found[0] != "class":
            return None
        sig = self.types.signature(found[1])
        problems = sig.problems(shape) if sig else []
        if sig is None or not problems:
            return None
        name = f"{_owner(callee, found[1])}.__init__"
        named = [callee[1]] if callee[0] in ("name", "inst") else []
        served = [param for owner in dict.fromkeys(named + [found[1].replace(":", ".")])
                  for param in self.serving.init_params.get(owner, [])]
        if served and not sig.widened([param for param, _patch in served]).problems(shape):
            used = [(param, patch) for param, patch in served  # the parameters this call needs served
                    if param_name(param) in set(shape.keywords).union(sig.required)]
            patches = tuple(dict.fromkeys(patch for _param, patch in used))
            return Result(PATCHED, name, patches, tuple(f"{name} takes {param} with {patch}" for param, patch in used))
        note = f"{'; '.join(problems)}: torch {self.types.inv.version}'s __init__ is {sig.text}"
        return Result(MISSING, name, note=note)

    def accepted_in(self, callee: TypeExpr, shapes: Sequence[CallShape]) -> List[str]:
        """The other inventoried torch versions whose class of ``callee`` takes every one of ``shapes``."""
        found = []
        for types in self.others:
            value = types.value(callee)
            sig = types.signature(value[1]) if value and value[0] == "class" else None
            if sig is not None and not any(sig.problems(s) for s in shapes):
                found.append(types.inv.version)
        return found
