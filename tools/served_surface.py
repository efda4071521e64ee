"""Each module torchpatch serves, against the newest torch's module of that name (issue 42).

    <venv>/bin/python tools/served_surface.py            # the installed torch: what its served modules lack
    <venv>/bin/python tools/served_surface.py --all      # declared gaps listed too, not only undeclared names

A served module is the newest torch's module, not the part of it one repository used: where torchpatch
serves a module that the installed torch lacks (a shim or an alias), or serves members onto one it has,
each name of that module's SURFACE in the newest inventoried torch is there with ``TORCHPATCH=1``, or is
declared in ``patches/_data/served_surface_gaps.json`` with the piece of torch it needs (or covered by an
entry of ``not_backportable.json``). The names are looked up live: the module imported and each name
read (``hasattr``) in one process with ``TORCHPATCH=1``; which modules are served, and what the installed
torch has natively, come from the catalogue's declarations and the installed torch's inventory.

SURFACE is decided on the newest inventory alone, dunder names aside: what the module's ``__all__``
lists; a class or function it defines (recorded as defined in the module or a submodule of it); a plain
value (constant, alias, instance) other than a typing or ``__future__`` name or a module-level logger.
Left out: names bound to modules (imports and submodules: a submodule is a module of its own), classes
and functions imported from elsewhere (``Optional``, ``DeviceMesh`` in a helper module), and the NCCL
backend classes, which exist only in builds with NCCL (compared build to build, not as API).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from api_coverage import BACKEND_CLASSES, FUTURE, LOGGERS, TYPING

from torchpatch import _versions
from torchpatch._check.base import not_backportable_for
from torchpatch._check.inventory import Inventory, inventory_files
from torchpatch._check.serving import Serving
from torchpatch._config import Config
from torchpatch._registry import builtin_patches, catalogue_data

GAPS = "served_surface_gaps.json"
SKIPPED = frozenset(BACKEND_CLASSES)

# Run with TORCHPATCH=1: argv[1] is a JSON file {module: [names]}; prints {module: {"absent": [...]}
# or {"error": why the import failed}}.
PROBE = """
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
with open(sys.argv[1]) as f:
    wanted = json.load(f)
out = {}
for module, names in wanted.items():
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        out[module] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    absent = []
    for name in names:
        try:
            getattr(mod, name)
        except Exception:
            absent.append(name)
    out[module] = {"absent": absent}
print(json.dumps(out))
"""


def newest() -> Inventory:
    return Inventory.load(list(inventory_files().values())[-1])


def installed_inventory(version: str) -> Optional[Inventory]:
    """The inventory of the installed torch's release, where there is one."""
    release = ".".join(map(str, (_versions.release(version) or ())[:3]))
    path = inventory_files().get(release)
    return Inventory.load(path) if path else None


def surface(inv: Inventory, module: str) -> Set[str]:
    """The names of ``module`` in ``inv`` that count (SURFACE, in the module's docstring)."""
    listed = set(inv.exports.get(module) or ())
    out = set()
    for name, value in inv.modules[module].items():
        if name in SKIPPED:
            continue
        if name in listed:
            out.add(name)
        elif value == "<module>":
            continue
        elif value:
            definer = value.split(":", 1)[0]
            if definer == module or definer.startswith(module + "."):
                out.add(name)
        elif name not in TYPING | FUTURE | LOGGERS:
            out.add(name)
    return out


@dataclass
class Served:
    """One served module on the installed torch: how it is served, what it has natively."""

    how: str  # "shim <patch>", "alias of <target> (<patch>)", "members (<patch>, ...)"
    native: Set[str] = field(default_factory=set)


def served_modules(version: str, here: Inventory, oracle: Inventory) -> Dict[str, Served]:
    """The modules of the oracle that torchpatch serves on ``version`` (every patch on): shims and
    aliases of modules ``here`` lacks, and modules ``here`` has that get at least one member served."""
    serving = Serving.for_torch(version, builtin_patches(), Config())
    out: Dict[str, Served] = {}
    for module, patch in serving.shims.items():
        if module not in here.modules and module in oracle.modules:
            out[module] = Served(f"shim {patch}")
    for module, (target, patch) in serving.aliases.items():
        if module not in here.modules and module not in out and module in oracle.modules:
            out[module] = Served(f"alias of {target} ({patch})", set(here.modules.get(target, ())))
    members: Dict[str, List[str]] = {}
    for (module, name), patch in serving.symbols.items():
        if module in here.modules and module in oracle.modules and name not in here.modules[module]:
            members.setdefault(module, []).append(patch)
    for module, patches in members.items():
        out[module] = Served(f"members ({', '.join(sorted(set(patches)))})", set(here.modules[module]))
    return dict(sorted(out.items()))


Gaps = Dict[Tuple[str, str], List[Tuple[str, str]]]  # (module, name) -> [(torch specifier, what it needs)]


def load_gaps() -> Gaps:
    """Each declared (module, name) -> its entries' torch specifiers and needs (the kind's line)."""
    data = json.loads((catalogue_data() / GAPS).read_text())
    out: Gaps = {}
    for entry in data["entries"]:
        need = f"{entry['kind']}: {data['kinds'][entry['kind']]}"
        for name in entry["names"]:
            out.setdefault((entry["module"], name), []).append((entry["torch"], need))
    return out


def pieces_markdown() -> str:
    """The declared gaps per piece, for docs/patches/newest-api.md: each piece's line (the file's ``kinds``),
    how many names it holds and in which modules."""
    data = json.loads((catalogue_data() / GAPS).read_text())
    names: Dict[str, Set[Tuple[str, str]]] = {}
    for entry in data["entries"]:
        names.setdefault(entry["kind"], set()).update((entry["module"], n) for n in entry["names"])
    lines = ["| piece | names | modules | what it is |", "|---|---:|---|---|"]
    for kind, line in sorted(data["kinds"].items(), key=lambda item: -len(names[item[0]])):
        modules = sorted({m for m, _ in names[kind]})
        shown = ", ".join(f"`{m}`" for m in modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
        lines.append(f"| `{kind}` | {len(names[kind])} | {shown} | {line} |")
    return "\n".join(lines)


def gaps_for(version: str, gaps: Gaps) -> Dict[Tuple[str, str], str]:
    """The declared gaps whose entry admits ``version`` -> what each needs."""
    return {key: need for key, entries in gaps.items() for spec, need in entries if _versions.matches(spec, version)}


def declared(module: str, name: str, version: str, here: Dict[Tuple[str, str], str]) -> str:
    """Why ``module.name`` may be absent on ``version`` (``here``: ``gaps_for(version, ...)``), or ""
    where nothing declares it."""
    need = here.get((module, name))
    if need:
        return need
    entry = not_backportable_for(f"{module}.{name}")
    if entry and not _versions.matches(entry["torch"], version):
        return f"not_backportable.json: {entry['what']}"
    return ""


def wanted(served: Dict[str, Served], oracle: Inventory) -> Dict[str, List[str]]:
    """Module -> the oracle's surface names it lacks natively (what the probe looks up)."""
    return {m: sorted(surface(oracle, m) - s.native) for m, s in served.items()}


@dataclass
class Difference:
    """The probe's answer: per served module, the surface names absent with TORCHPATCH=1."""

    absent: Dict[str, List[str]]
    errors: Dict[str, str]  # module -> why it failed to import

    def undeclared(self, version: str, gaps: Gaps) -> List[str]:
        applying = gaps_for(version, gaps)
        return [f"{m}.{n}" for m, names in self.absent.items() for n in names if not declared(m, n, version, applying)]


def difference(probed: Dict[str, Dict[str, Any]], asked: Dict[str, List[str]]) -> Difference:
    """PROBE's output as a Difference: a module that failed to import lacks every name asked of it."""
    errors = {m: str(r["error"]) for m, r in probed.items() if "error" in r}
    absent = {m: asked[m] if m in errors else list(r["absent"]) for m, r in probed.items()}
    return Difference({m: a for m, a in absent.items() if a}, errors)


def stale(version: str, served: Dict[str, Served], diff: Difference, gaps: Gaps) -> List[str]:
    """Declared gaps that apply on ``version`` (the module served here, the name not native) yet are there."""
    out = []
    for module, name in sorted(gaps_for(version, gaps)):
        if module in served and name not in served[module].native and module not in diff.errors:
            if name not in diff.absent.get(module, ()):
                out.append(f"{module}.{name}")
    return out


def probe(asked: Dict[str, List[str]], path: str) -> Dict[str, Dict[str, Any]]:
    """Run PROBE in a fresh interpreter with TORCHPATCH=1 (and this checkout's torchpatch first)."""
    with open(path, "w") as f:
        json.dump(asked, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPATCH")}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env.update(TORCHPATCH="1", PYTHONPATH=os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, "-c", PROBE, path], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="list the declared gaps too")
    args = parser.parse_args(argv)
    version = _versions.torch_version() or ""
    here, oracle = installed_inventory(version), newest()
    if here is None:
        parser.error(f"torch {version} has no inventory (tools/inventory.py writes one)")
    served = served_modules(version, here, oracle)
    asked = wanted(served, oracle)
    with tempfile.TemporaryDirectory() as tmp:
        diff = difference(probe(asked, os.path.join(tmp, "names.json")), asked)
    gaps = load_gaps()
    applying = gaps_for(version, gaps)
    print(f"torch {version}: {len(served)} served modules against torch {oracle.version}'s; "
          f"{sum(map(len, asked.values()))} surface names lacking natively, "
          f"{sum(map(len, diff.absent.values()))} absent with TORCHPATCH=1, "
          f"{len(diff.undeclared(version, gaps))} of them undeclared")
    for module, names in diff.absent.items():
        shown = [n for n in names if args.all or not declared(module, n, version, applying)]
        if shown:
            print(f"  {module} [{served[module].how}] ({len(shown)}): {' '.join(shown)}")
        if module in diff.errors:
            print(f"    import failed: {diff.errors[module]}")
    for name in stale(version, served, diff, gaps):
        print(f"  STALE declared gap, present here: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
