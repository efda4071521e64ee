"""Derive torchpatch's relocation table from the torch inventories (tools/inventory.py).

    python tools/relocations.py            # print the table
    python tools/relocations.py --write    # write patches/_data/relocations.json
    python tools/relocations.py --check    # exit 1 if patches/_data/relocations.json is out of date

A module that exists under one path in some matrix torches and is missing in others, where a module
under a corresponding path (same package family, same last name up to a leading underscore) defines
at least half of its classes and functions under the same qualified names, is a relocation: where
the path is missing, torchpatch serves it as the very module under its other name (and a missing
parent package as the target's parent, where that defines the same things). Where a public function
or class common to both changed its call signature, or the parent package cannot be served, the
entry is kept with ``"alias": false`` and the reason, and is not served. Where another patch of the
catalogue serves the same path, that patch wins (the engine arms the first server of a name, and a
built shim before any alias).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
INVENTORY = ROOT / "src" / "torchpatch" / "patches" / "_data" / "inventory"
TABLE = ROOT / "src" / "torchpatch" / "patches" / "_data" / "relocations.json"
FAMILY = "torch.distributed."
MIN_OVERLAP = 0.5


def load_inventories() -> Dict[str, dict]:
    out = {}
    for path in INVENTORY.glob("torch-*.json.gz"):
        data = json.loads(gzip.decompress(path.read_bytes()))
        out[data["torch"]] = data
    return dict(sorted(out.items(), key=lambda kv: tuple(int(x) for x in kv[0].split("."))))


def defined(inv: dict, module: str) -> Set[str]:
    """Qualified names of the classes and functions ``module`` defines itself."""
    prefix = module + ":"
    return {d[len(prefix):] for d in inv["modules"][module].values() if d.startswith(prefix)}


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1].lstrip("_")


def counterpart(invs: Dict[str, dict], name: str, version: str, source: str) -> Optional[Tuple[str, float]]:
    """The module of ``version`` that ``name`` (as it exists in ``source``) moved to, if any."""
    wanted = defined(invs[source], name)
    if not wanted:
        return None
    best: Optional[Tuple[str, float]] = None
    for other in invs[version]["modules"]:
        if other == name or not other.startswith(FAMILY) or _leaf(other) != _leaf(name):
            continue
        overlap = len(wanted & defined(invs[version], other)) / len(wanted)
        if overlap >= MIN_OVERLAP and (best is None or overlap > best[1]):
            best = (other, overlap)
    return best


def signature_changes(invs: Dict[str, dict], name: str, source: str, target: str, version: str) -> List[str]:
    old = invs[source].get("signatures", {}).get(name, {})
    new = invs[version].get("signatures", {}).get(target, {})
    return sorted(f"{n}{old[n]} became {n}{new[n]}" for n in old.keys() & new.keys() if old[n] != new[n])


def record(entries: Dict[Tuple[str, str], dict], invs: Dict[str, dict], name: str, target: str,
           overlap: float, source: str, version: str) -> None:
    """Note that on ``version``, missing ``name`` is ``target`` (qualnames common to all versions)."""
    common = defined(invs[source], name) & defined(invs[version], target)
    entry = entries.setdefault((name, target), {
        "name": name, "target": target, "versions": [], "overlap": round(overlap, 2),
        "qualnames": sorted(common), "reference": source, "changed": [], "missing_parent": [],
    })
    if version in entry["versions"]:
        return
    entry["versions"].append(version)
    entry["qualnames"] = sorted(set(entry["qualnames"]) & common)
    entry["changed"] = sorted(set(entry["changed"]) | set(signature_changes(invs, name, source, target, version)))


def specifier(versions: List[str], matrix: List[str]) -> str:
    """``>=first,<next`` over the matrix versions an entry covers (contiguous in the matrix)."""
    first = ".".join(versions[0].split(".")[:2])
    last_index = matrix.index(versions[-1])
    if last_index == len(matrix) - 1:
        return f">={first}"
    nxt = ".".join(matrix[last_index + 1].split(".")[:2])
    return f">={first},<{nxt}"


def derive() -> List[dict]:
    invs = load_inventories()
    matrix = list(invs)
    everything = sorted({m for inv in invs.values() for m in inv["modules"] if m.startswith(FAMILY)})
    entries: Dict[Tuple[str, str], dict] = {}
    for name in everything:
        present = [v for v in matrix if name in invs[v]["modules"]]
        for version in matrix:
            ancestors = [name.rsplit(".", k)[0] for k in range(name.count(".") + 1)]
            if name in invs[version]["modules"] or any(a in invs[version]["failing"] for a in ancestors):
                continue  # present, or not knowable: it (or its package) fails to import natively there
            # the nearest version that has the module is its reference
            source = min(present, key=lambda v: abs(matrix.index(v) - matrix.index(version)))
            found = counterpart(invs, name, version, source)
            if found is None:
                continue
            target, overlap = found
            record(entries, invs, name, target, overlap, source, version)
            # ``import a.b.c`` needs ``a.b``: a missing parent package is served as the target's
            # parent where that defines the same things, else the module cannot be served here.
            parent, target_parent = name.rsplit(".", 1)[0], target.rsplit(".", 1)[0]
            if parent not in invs[version]["modules"] and parent != target_parent:
                wanted = defined(invs[source], parent)
                have = defined(invs[version], target_parent) if target_parent in invs[version]["modules"] else set()
                if wanted:
                    share = len(wanted & have) / len(wanted)
                else:  # a package that only gathers its submodules: same name is all there is to compare
                    share = float(target_parent in invs[version]["modules"] and _leaf(parent) == _leaf(target_parent))
                if share >= MIN_OVERLAP:
                    record(entries, invs, parent, target_parent, share, source, version)
                    entries[(parent, target_parent)]["package"] = True
                else:
                    entries[(name, target)]["missing_parent"].append(parent)
    # A package alias brings every submodule along (the same objects, under the alias): serve one
    # only where none of its relocated submodules is refused.
    for (name, _target), entry in entries.items():
        if entry.get("package"):
            refused = sorted(e["name"] for (n, _t), e in entries.items() if n.startswith(name + ".") and e["changed"])
            if refused:
                entry["changed"].append("submodules that changed: " + ", ".join(refused))
    for (name, _target), entry in entries.items():
        parent = name.rsplit(".", 1)[0]
        if any(n == parent and e["changed"] for (n, _t), e in entries.items()):
            entry["missing_parent"].append(parent)
    table = []
    for entry in entries.values():
        entry.pop("package", None)
        versions = entry.pop("versions")
        # split into runs that are contiguous in the matrix
        runs: List[List[str]] = []
        for v in versions:
            if runs and matrix.index(v) == matrix.index(runs[-1][-1]) + 1:
                runs[-1].append(v)
            else:
                runs.append([v])
        changed, missing_parent = entry.pop("changed"), sorted(set(entry.pop("missing_parent")))
        why = (["signatures changed: " + "; ".join(changed)] if changed else []) + (
            [f"its package {p} is not served there" for p in missing_parent])
        for run in runs:
            table.append(dict(entry, torch=specifier(run, matrix), checked_on=run, alias=not why,
                              **({"why_not": "; ".join(why)} if why else {})))
    return sorted(table, key=lambda e: (e["name"], e["torch"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = json.dumps(derive(), indent=1) + "\n"
    if args.check:
        if not TABLE.exists() or TABLE.read_text() != text:
            print("patches/_data/relocations.json is out of date: run python tools/relocations.py --write", file=sys.stderr)
            return 1
        return 0
    if args.write:
        TABLE.write_text(text)
        table = json.loads(text)
        print(f"{TABLE}: {len(table)} entries, {sum(e['alias'] for e in table)} served as aliases")
        return 0
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
