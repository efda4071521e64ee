"""How much of the newest torch's public distributed API torchpatch gives each older minor (issue 27).

    python tools/api_coverage.py                 # per minor: lacking, served, not servable, missing, unknown
    python tools/api_coverage.py --names 2.13    # one minor's names that are not served, by module
    python tools/api_coverage.py --markdown      # the table and its definition, for a docs page

Read from the inventories (``patches/_data/inventory``, written by ``tools/inventory.py``) and the
catalogue; each minor is its newest inventoried release. Every public name of the newest inventoried
torch under ROOTS that a minor lacks natively is, on that minor, with TORCHPATCH=1 (every patch on):

- **served**: the engine's resolver (``torchpatch check``'s) finds it through a patch;
- **not servable**: an entry of ``not_backportable.json`` covers it (its reason is printed);
- **missing**: neither (the work list of issue 27);
- **unknown**: the inventory cannot tell (the module failed to import when it was taken), or the name
  is a backend class that the inventoried build was compiled without (the NCCL classes on a CPU-only
  build): listed apart, not counted as lacking nor in the served share.

PUBLIC (below, in ``DEFINITION``) is decided from the newest inventory alone (its ``exports``: each
module's ``__all__``). Inventories record where classes and functions are defined, not where a plain
value (a constant, a type alias, an instance) comes from; so a name that a package re-exports from one
of its public submodules (``torch.distributed.checkpoint.FsspecReader``) counts once, under the
submodule that defines it.
"""

from __future__ import annotations

import __future__
import argparse
import sys
import typing
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from support_chart import minor_releases

from torchpatch import _versions
from torchpatch._check.base import MISSING, NATIVE, PATCHED, UNKNOWN, not_backportable_for
from torchpatch._check.inventory import Inventory, InventoryView, all_inventories
from torchpatch._check.resolve import Resolver
from torchpatch._check.serving import Serving
from torchpatch._config import Config
from torchpatch._registry import builtin_patches

ROOTS = ("torch.distributed", "torch.nn.attention", "torch.utils.checkpoint")
OLDEST = (2, 4)
# (first minor, last minor, share of the lacking names to serve): issue 27's targets
TARGETS = (((2, 13), (2, 14), 0.9), ((2, 9), (2, 12), 0.8), ((2, 4), (2, 8), 0.6))
# typing's names (those of Pythons newer than this one too): imports, whatever the inventory says
TYPING = frozenset(typing.__all__) | {"TypeIs", "ReadOnly", "NoDefault", "TypeAliasType", "Never", "Self",
                                      "LiteralString", "Unpack", "Required", "NotRequired", "TypeVarTuple",
                                      "override", "assert_never", "assert_type", "reveal_type",
                                      "dataclass_transform", "deprecated"}
LOGGERS = frozenset({"log", "logger"})
FUTURE = frozenset(__future__.all_feature_names)  # ``from __future__ import annotations`` leaves a name
DEFINITION = (
    "A module is public when it is under torch.distributed, torch.nn.attention or torch.utils.checkpoint and no "
    "dotted part of its name starts with `_`; each public module counts as one name. A name of a public module "
    "is public when the module's `__all__` lists it; in a module without `__all__`, when it does not start with "
    "`_` and is defined there: a class or function whose `__module__` is that module or one of its private "
    "submodules (`torch.distributed.tensor._api.DTensor` is `torch.distributed.tensor.DTensor`), or a plain value "
    "(constant, alias) other than a typing or `__future__` name or a module-level logger. A class or function "
    "listed by several public modules counts once, in the one that defines it (`FsspecReader` in "
    "`torch.distributed.checkpoint.fsspec_filesystem`, not in `torch.distributed.checkpoint`); submodules count as "
    "modules, not as names. Decided on the newest torch's inventory, which records each module's `__all__`.")
# distributed_c10d lists a backend's classes in __all__ only where torch was built with that backend: name
# -> (backend, the class whose absence says the inventoried build lacks it)
BACKEND_CLASSES = {name: ("NCCL", "ProcessGroupNCCL")
                   for name in ("ProcessGroupNCCL", "ProcessGroupNCCL2", "ProcessGroupNCCLLazy")}
LACKING = ("served", "not servable", "missing")  # the states of a name a minor is known to lack
STATES = LACKING + ("unknown",)  # unknown: not counted as lacking (nor in the shares)


def is_public_module(name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in ROOTS) and not any(
        part.startswith("_") for part in name.split("."))


def home(value: str) -> Optional[str]:
    """The module whose name a class or function recorded as ``"definer:qualname"`` counts under: its
    definer without the private tail (``torch.distributed.tensor._api`` -> ``torch.distributed.tensor``);
    None for a plain value (``""``), which tells nothing of where it comes from."""
    if not value:
        return None
    parts = value.split(":", 1)[0].split(".")
    while len(parts) > 1 and parts[-1].startswith("_"):
        parts.pop()
    return ".".join(parts)


def defined_in(module: str, value: str) -> bool:
    """Whether an inventory's record of a name of ``module`` (``"module:qualname"`` for classes and
    functions, ``""`` for plain values) says the name is defined there (or in a private submodule of it)
    rather than imported."""
    return not value or home(value) == module


def _counted_at_home(inv: Inventory, modules: Set[str], module: str, value: str) -> bool:
    """Whether a class or function that ``module`` lists is another public module's own (a re-export)."""
    where = home(value)
    if where is None or where == module or where not in modules:
        return False
    qualname = value.split(":", 1)[1]
    return qualname in (inv.exports.get(where) or inv.modules[where])


def public_names(inv: Inventory) -> List[str]:
    """The dotted public names (modules and names, as DEFINITION says) of one inventory, sorted."""
    modules = {m for m in inv.modules if is_public_module(m)}
    out = []
    for module in modules:
        names, listed = inv.modules[module], inv.exports.get(module)
        out.append(module)
        for name, value in names.items():
            if value == "<module>":
                continue
            if listed is not None:  # __all__: what it lists, counted once, where it is defined
                if name in listed and not _counted_at_home(inv, modules, module, value):
                    out.append(f"{module}.{name}")
            elif not (name.startswith("_") or name in LOGGERS or (not value and name in TYPING | FUTURE)
                      or not defined_in(module, value)):
                out.append(f"{module}.{name}")
    return sorted(out)


def reexports(inv: Inventory) -> Dict[str, List[str]]:
    """Public name -> the other public modules' names for the same class or function (its re-exports,
    not counted themselves: ``torch.distributed.set_timeout`` for ``...distributed_c10d.set_timeout``)."""
    counted = set(public_names(inv))
    values = {n: inv.modules[n.rsplit(".", 1)[0]][n.rsplit(".", 1)[1]] for n in counted if n not in inv.modules}
    homes = {value: n for n, value in values.items() if value}  # plain values ("") tell nothing of where from
    out: Dict[str, List[str]] = {}
    for module, names in inv.modules.items():
        if not is_public_module(module):
            continue
        for name, value in names.items():
            full = f"{module}.{name}"
            if value in homes and full not in counted and not name.startswith("_"):
                out.setdefault(homes[value], []).append(full)
    return out


@dataclass
class Coverage:
    """One minor against the newest torch: its lacking public names, by state."""

    version: str
    lacking: Dict[str, List[str]] = field(default_factory=lambda: {s: [] for s in STATES})
    reasons: Dict[str, str] = field(default_factory=dict)  # not servable or unknown name -> why

    @property
    def total(self) -> int:
        """The names known to be lacking (unknown ones aside)."""
        return sum(len(self.lacking[s]) for s in LACKING)

    def share(self, state: str) -> float:
        return len(self.lacking[state]) / self.total if self.total else 1.0


def not_built(inv: Inventory) -> Dict[str, str]:
    """The backend classes the inventoried build of torch was compiled without -> why they are unknown."""
    c10d = inv.modules.get("torch.distributed.distributed_c10d", {})
    return {f"torch.distributed.distributed_c10d.{name}": (
        f"torch {inv.version}'s inventory is of a build without {backend}: its backend classes exist only in "
        f"builds with {backend} (compared build to build, not as API)")
        for name, (backend, marker) in BACKEND_CLASSES.items() if marker not in c10d}


def classify(names: Iterable[str], resolver: Resolver, version: str,
             homes: Optional[Dict[str, List[str]]] = None, unbuilt: Optional[Dict[str, str]] = None) -> Coverage:
    """The names that ``version`` lacks natively, each served, not servable, missing or unknown (also
    the build features its build lacks, ``unbuilt``); a missing one that a patch serves under one of its
    re-exports (``homes``) says so in ``reasons``."""
    out = Coverage(version)
    for name in names:
        if name in (unbuilt or {}):
            out.lacking["unknown"].append(name)
            out.reasons[name] = unbuilt[name]
            continue
        result = resolver.resolve(name)
        if result.status == NATIVE:
            continue
        if result.status == PATCHED:
            out.lacking["served"].append(name)
            continue
        entry = not_backportable_for(name)
        if entry and not _versions.matches(entry["torch"], version):
            out.lacking["not servable"].append(name)
            out.reasons[name] = f"{entry['what']} (torch {entry['torch']}): {entry['why']}"
        elif result.status == UNKNOWN:
            out.lacking["unknown"].append(name)
            out.reasons[name] = result.note
        else:
            assert result.status == MISSING, result
            out.lacking["missing"].append(name)
            served_as = [h for h in (homes or {}).get(name, ()) if resolver.resolve(h).status == PATCHED]
            if served_as:
                out.reasons[name] = "served as " + ", ".join(served_as)
    return out


def target(version: str) -> Optional[float]:
    minor = (_versions.release(version) or ())[:2]
    return next((share for first, last, share in TARGETS if first <= minor <= last), None)


def coverage_of(inv: Inventory, newest: Inventory) -> Coverage:
    """One inventoried release's coverage of the newest torch's public names (every patch on)."""
    resolver = Resolver(InventoryView(inv, all_inventories()), inv.version,
                        Serving.for_torch(inv.version, builtin_patches(), Config()))
    return classify(public_names(newest), resolver, inv.version, reexports(newest), not_built(inv))


def coverage() -> Tuple[Inventory, List[Coverage]]:
    """The newest inventory and each older minor's coverage, from OLDEST up."""
    releases = minor_releases()
    newest = releases[-1]
    return newest, [coverage_of(inv, newest) for inv in releases[:-1]
                    if (_versions.release(inv.version) or ())[:2] >= OLDEST]


def by_module(names: Sequence[str], modules: Iterable[str]) -> Dict[str, List[str]]:
    """Names under the module that holds them (the longest of ``modules`` that prefixes them)."""
    known = sorted(set(modules), key=len, reverse=True)
    out: Dict[str, List[str]] = {}
    for name in names:
        home = next((m for m in known if name == m or name.startswith(m + ".")), name.rsplit(".", 1)[0])
        out.setdefault(home, []).append(name[len(home) + 1:] or "(the module)")
    return dict(sorted(out.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def _row(c: Coverage) -> List[str]:
    goal = target(c.version)
    met = "" if goal is None else ("yes" if c.share("served") >= goal else "no")
    return [c.version, str(c.total)] + [str(len(c.lacking[s])) for s in STATES] + [
        f"{100 * c.share('served'):.0f}%", "" if goal is None else f"{100 * goal:.0f}%", met]


HEAD = ["torch", "lacking", *STATES, "served share", "target", "met"]


def summary(newest: Inventory, rows: Sequence[Coverage]) -> str:
    lines = [f"torch {newest.version} has {len(public_names(newest))} public names (modules included); those each "
             "minor lacks natively, and what TORCHPATCH=1 makes of them there:", ""]
    table = [HEAD] + [_row(c) for c in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEAD))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in table]
    failing = sorted(m for m in newest.failing if is_public_module(m))
    if failing:
        lines += ["", f"Not counted (failed to import when torch {newest.version}'s inventory was taken): "
                  + ", ".join(failing)]
    return "\n".join(lines + ["", "Public: " + DEFINITION])


def markdown(newest: Inventory, rows: Sequence[Coverage]) -> str:
    """The table, the definition, each minor's names that are not served, and why, once per reason."""
    lines = [f"| {' | '.join(HEAD)} |", "|" + "---:|" * len(HEAD)]
    lines += [f"| {' | '.join(_row(c))} |" for c in rows]
    lines += ["", "**Public.** " + DEFINITION, "", "### Not served, per minor", ""]
    modules = [n for n in public_names(newest) if n in newest.modules]
    entries: Dict[str, Dict[str, str]] = {}  # entry name -> the entry, for the reasons below
    for c in rows:
        if not (c.lacking["not servable"] or c.lacking["missing"]):
            lines.append(f"- **{c.version}**: every lacking name is served.")
            continue
        lines.append(f"- **{c.version}**:")
        for state in ("not servable", "missing"):
            for module, short in by_module(c.lacking[state], modules).items():
                full = [module if n == "(the module)" else f"{module}.{n}" for n in short]
                why = [not_backportable_for(n) for n in full] if state == "not servable" else []
                entries.update((e["name"], e) for e in why if e)
                tail = ": not servable (why: below)" if why else ": not served yet"
                lines.append(f"    - `{module}`: {', '.join(f'`{n}`' for n in short)}{tail}")
    if entries:
        lines += ["", "### Why they cannot be served", ""]
        lines += [f"- `{e['name']}`, {e['what']} (native in torch {e['torch']}): {e['why']}"
                  for _, e in sorted(entries.items())]
    return "\n".join(lines)


def in_one_line(newest: Inventory, rows: Sequence[Coverage]) -> str:
    """The README's sentence: the served share of each minor's lacking names."""
    shares = ", ".join(f"{100 * c.share('served'):.0f}% on {'.'.join(c.version.split('.')[:2])}" for c in rows)
    unserved = [c for c in rows if c.lacking["missing"]]
    rest = "the rest is declared not servable, with the piece of torch it needs" if not unserved else (
        "the rest is declared not servable, with the piece of torch it needs, except "
        + ", ".join(f"{len(c.lacking['missing'])} on {c.version}" for c in unserved) + " not served yet")
    return (f"**The newest API on older torch.** Of the public names of torch {newest.version} under "
            f"{', '.join(f'`{r}`' for r in ROOTS)} that a minor lacks, torchpatch serves {shares}; {rest} "
            "([the table, what public means, and what cannot be served](docs/patches/newest-api.md)).")


def names(newest: Inventory, c: Coverage) -> str:
    modules = [n for n in public_names(newest) if n in newest.modules]
    lines = [f"torch {c.version}: {c.total} public names of torch {newest.version} lacking; "
             + ", ".join(f"{len(c.lacking[s])} {s}" for s in STATES)]
    for state in ("missing", "unknown", "not servable"):
        if not c.lacking[state]:
            continue
        lines += ["", f"{state.upper()} ({len(c.lacking[state])}):"]
        for module, held in by_module(c.lacking[state], modules).items():
            full = {n: module if n == "(the module)" else f"{module}.{n}" for n in held}
            if state == "missing":  # a re-export served elsewhere is noted beside the name
                held = [f"{n} ({c.reasons[full[n]]})" if full[n] in c.reasons else n for n in held]
            lines.append(f"  {module} ({len(held)}): {', '.join(held)}")
            if state != "missing":
                lines += [f"    why: {r}" for r in dict.fromkeys(c.reasons[full[n]] for n in held)]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", metavar="MINOR", help="list one minor's (e.g. 2.13) unserved names by module")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown, for a docs page")
    args = parser.parse_args(argv)
    newest, rows = coverage()
    if args.names:
        chosen = [c for c in rows if c.version == args.names or c.version.startswith(args.names + ".")]
        if not chosen:
            parser.error(f"no inventoried minor {args.names}: use one of {', '.join(c.version for c in rows)}")
        print(names(newest, chosen[0]))
    elif args.markdown:
        print(markdown(newest, rows))
    else:
        print(summary(newest, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
