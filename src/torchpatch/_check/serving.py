"""What torchpatch serves on one torch version: the catalogue's declarations, read as data, with the
patches switched on or off as the ``TORCHPATCH_*`` variables say."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Set, Tuple

from .. import _versions
from .._config import Config, Decision, decide
from .._plan import applicability
from .._patch import Patch


@dataclass
class Serving:
    """The catalogue's module shims, aliases and symbols that serve a name on one torch version.

    ``symbols`` holds what a patch serves with ``Patch.symbol`` and what it declares with
    ``Patch.sets``: names set on a module (a shim module's names included) or, with a class's
    dotted name as the module, members set on that class.
    """

    shims: Dict[str, str] = field(default_factory=dict)  # module -> patch id
    aliases: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # module -> (target, patch id)
    symbols: Dict[Tuple[str, str], str] = field(default_factory=dict)  # (module, name) -> patch id
    off: Dict[str, str] = field(default_factory=dict)  # name a switched-off patch would serve -> why
    declared: Set[str] = field(default_factory=set)  # modules with at least one name in ``symbols``
    decisions: Dict[str, Decision] = field(default_factory=dict)  # patch id -> on/off and why (applying ones)
    init_params: Dict[str, List[Tuple[str, str]]] = field(default_factory=dict)  # class -> [(param, patch id)]

    @classmethod
    def for_torch(cls, version: str, patches: Sequence[Patch], cfg: Config) -> "Serving":
        applies = {p.id: applicability(p.torch, p.python, version)[0] for p in patches}
        decisions = decide(cfg, patches, inapplicable={i for i, yes in applies.items() if not yes})
        out = cls()
        for p in patches:
            if not applies[p.id]:
                continue
            out.decisions[p.id] = decisions[p.id]
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
                out.declared.add(key[0])
            for cls, param in p.init_params:
                out.init_params.setdefault(cls, []).append((param, p.id))
        return out

    def alias_targets(self) -> Dict[str, str]:
        """Served module name -> the module it is an alias of."""
        return {name: target for name, (target, _patch) in self.aliases.items()}
