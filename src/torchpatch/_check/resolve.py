"""Resolving one dotted torch name on one torch version: natively (a view of what exists) or
through the catalogue (:class:`~.serving.Serving`), part by part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .. import _versions
from .base import ATTR, MISSING, MODULE, OPS, PATCHED, NATIVE, ROOT, UNKNOWN, Result, not_backportable_for
from .serving import Serving

Found = Tuple[str, Any, str, str, str]  # (kind, _Mod for a module, serving patch id, how it is served, note)


@dataclass(frozen=True)
class _Mod:
    shown: str  # the name the code uses
    real: str  # the torch module whose contents it has ("" for a torchpatch shim)
    shim: str = ""  # patch id serving it as a shim
    shim_name: str = ""  # the name the shim is served under


class Resolver:
    """Resolves dotted torch names on one torch version: natively (``view``) or via ``serving``.

    The names a shim module holds are those its patch declares (``Patch.symbol``, ``Patch.sets``);
    where the target torch is installed, ``shim_view`` (the installed torch with torchpatch on)
    finds the others by building the shim. A name no declaration and no build vouches for is
    missing: a shim with declared names holds no others; one that declares none is undecided.
    """

    def __init__(self, view: Any, version: str, serving: Optional[Serving] = None, shim_view: Any = None) -> None:
        self.view = view
        self.version = version
        self.serving = serving or Serving()
        self.shim_view = shim_view
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

    def _child(self, mod: _Mod, part: str, depth: int) -> Found:
        """What ``mod.part`` is, natively or served."""
        undecided = ""
        if mod.real:
            kind, real, note = self.view.child(mod.real, part)
            if kind == MODULE:
                return MODULE, _Mod(f"{mod.shown}.{part}", real), "", "", ""
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

    def _served(self, mod: _Mod, part: str, depth: int) -> Optional[Found]:
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
            return self._in_shim(mod, part)
        return None

    def _in_shim(self, mod: _Mod, part: str) -> Optional[Found]:
        """A name its patch does not declare, inside a shim module: built where torch is installed."""
        if self.shim_view is not None:
            kind, _real, note = self.shim_view.child(mod.shim_name, part)
            if kind in (ATTR, MODULE):
                return ATTR, None, mod.shim, f"{mod.shim_name}.{part} found by building {mod.shim}'s shim here", ""
            if kind == UNKNOWN:
                return UNKNOWN, None, "", "", note
            return None
        if mod.shim_name in self.serving.declared:
            return None
        return (UNKNOWN, None, "", "", f"{mod.shown} is a torchpatch shim ({mod.shim}) that declares none of its names "
                "(Patch.sets); where its torch is installed, check builds it to see")

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
