"""The report: every torch name, member and constructor call the scan found, resolved on the
target, one row per distinct name with its kind, guards, locations and notes; and its text form."""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .._config import Config
from .._patch import Patch
from .._registry import all_patches
from .base import GUARDED, KINDS, MISSING, NATIVE, PATCHED, UNKNOWN, UNRESOLVED, Result, not_backportable_for
from .inventory import InventoryView, all_inventories
from .members import MemberChecker, followed
from .resolve import Resolver
from .scan import FileScan, python_files, scan_file, shown
from .serving import Serving
from .signature import CallShape
from .target import Target

Place = Tuple[int, int, Tuple[int, ...]]  # (file index, line, guard indices)


@functools.lru_cache(maxsize=None)
def _native_resolvers() -> Tuple[Tuple[str, Resolver], ...]:
    inventories = all_inventories()
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


@dataclass
class _Row:
    result: Result
    exists: Callable[[], List[str]]  # the inventoried versions that have it
    notes: List[str] = field(default_factory=list)
    places: List[Place] = field(default_factory=list)


class _Rows:
    """Rows by name, as the uses found by the scan come in."""

    def __init__(self, scans: Sequence[FileScan]) -> None:
        self.scans = scans
        self.rows: Dict[str, _Row] = {}
        self.tried: Dict[Tuple[int, int], List[Result]] = {}  # (file, "try" guard) -> what its body uses

    def add(self, key: str, result: Result, note: str, exists: Callable[[], List[str]], place: Place) -> None:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = _Row(result, exists)
        if note and note not in row.notes:
            row.notes.append(note)
        row.places.append(place)
        f, _line, guards = place
        for g in guards:
            if self.scans[f].guards[g].kind == "try":
                self.tried.setdefault((f, g), []).append(result)

    def effective(self, f: int, g: int) -> bool:
        guard = self.scans[f].guards[g]
        if guard.kind != "fallback":
            return True  # an except branch is guarded only while what it stands in for resolves
        tried = self.tried.get((f, guard.partner), [])
        return bool(tried) and all(r.status != MISSING for r in tried)

    def table(self) -> List[Dict[str, Any]]:
        scans, out = self.scans, []
        for key, row in self.rows.items():
            result = row.result
            guarded_by: List[str] = []
            unguarded = False
            for f, _line, guards in row.places:
                active = [scans[f].guards[g].text for g in guards if self.effective(f, g)]
                unguarded |= not active
                guarded_by += [a for a in active if a not in guarded_by]
            kind = result.status if result.status != MISSING else UNRESOLVED if unguarded else GUARDED
            entry: Dict[str, Any] = {
                "name": key,
                "kind": kind,
                "patches": list(result.patches),
                "how": list(result.how),
                "note": "; ".join(row.notes),
                "guarded": not unguarded,
                "guards": guarded_by[:5],
                "locations": [{"file": scans[f].path, "line": line} for f, line, _g in
                              sorted(row.places, key=lambda p: (scans[p[0]].path, p[1]))],
            }
            if kind in (UNRESOLVED, GUARDED, UNKNOWN):
                entry["exists_in"] = row.exists()
                entry["not_backportable"] = not_backportable_for(key)
            out.append(entry)
        order = {k: i for i, k in enumerate(KINDS)}
        out.sort(key=lambda r: (order[r["kind"]], r["name"]))
        return out


def _rows(scans: Sequence[FileScan], resolver: Resolver, members: MemberChecker,
          progress: Callable[[str], None]) -> List[Dict[str, Any]]:
    rows = _Rows(scans)
    total = len({name for scan in scans for name, _line, _guards in scan.names})
    names: Dict[str, Tuple[Result, str, str]] = {}  # name -> (result, row name, note)
    used: Dict[Tuple[Any, str], Optional[Result]] = {}  # (receiver, member) -> result
    calls: Dict[Tuple[Any, CallShape], Optional[Result]] = {}
    shapes: Dict[str, List[CallShape]] = {}  # a call row -> the argument shapes of its calls

    def member(receiver: Any, name: str, place: Place) -> None:
        if (receiver, name) not in used:
            used[(receiver, name)] = members.member(receiver, name)
        result = used[(receiver, name)]
        if result is not None:
            rows.add(result.key, result, result.note, functools.partial(members.exists_in, receiver, name), place)

    for f, scan in enumerate(scans):
        for name, line, guards in scan.names:
            if name not in names:
                progress(f"resolving torch name {len(names) + 1}/{total}: {name}")
                result = resolver.resolve(name)
                names[name] = (result,) + _row_key(name, result)
            result, key, note = names[name]
            rows.add(key, result, note, functools.partial(exists_in, key), (f, line, guards))
            rest = name[len(result.key) + 1:].split(".", 1)[0] if name.startswith(result.key + ".") else ""
            if rest and result.status in (NATIVE, PATCHED):  # a member of a class the name reaches
                member(("name", result.key), rest, (f, line, guards))
        for receiver, name, line, guards in scan.members:
            member(receiver, name, (f, line, guards))
        for callee, shape, line, guards in scan.calls:
            if (callee, shape) not in calls:
                calls[(callee, shape)] = members.call(callee, shape)
            rejected = calls[(callee, shape)]
            if rejected is not None:
                seen = shapes.setdefault(rejected.key, [])
                seen.append(shape)
                rows.add(rejected.key, rejected, rejected.note, functools.partial(members.accepted_in, callee, seen),
                         (f, line, guards))
    return rows.table()


def _quiet(text: str) -> None:
    pass


def _scan(files: Sequence[str], target: Target, progress: Callable[[str], None]) -> List[FileScan]:
    """The scans of the files that mention torch, telling ``progress`` which file is read."""
    classes = frozenset(k.rsplit(":", 1)[1].rsplit(".", 1)[-1] for k in target.inventory.classes
                        if followed(k, target.inventory))
    collecting = gc.isenabled()
    gc.disable()  # parsing allocates millions of AST nodes and makes no cycles: collections only cost time
    try:
        scans = []
        for i, path in enumerate(files):
            progress(f"scanning file {i + 1}/{len(files)}: {shown(path)}")
            scan = scan_file(path, shown(path), classes)
            if scan is not None:
                scans.append(scan)
    finally:
        if collecting:
            gc.enable()
    return scans


def check(paths: Sequence[str], target: Target, patches: Optional[Sequence[Patch]] = None,
          cfg: Optional[Config] = None, progress: Callable[[str], None] = _quiet) -> Dict[str, Any]:
    """Scan ``paths`` and resolve every torch name on ``target``: the report as a dict.
    ``progress`` is told what is being done, as it goes."""
    target.start()  # the installed torch imports in a helper while the files are scanned
    try:
        cfg = cfg or Config.from_environ()
        serving = Serving.for_torch(target.version, all_patches() if patches is None else patches, cfg)
        files = list(python_files(paths))
        scans = _scan(files, target, progress)
        if any(name.startswith(shim + ".") for scan in scans for name, _l, _g in scan.names for shim in serving.shims):
            target.start_shims()  # names inside shim modules: the helper with torchpatch on will be asked
        resolver = Resolver(target.view, target.version, serving, target.shim_view)
        members = MemberChecker(target.inventory, all_inventories(), serving)
        rows = _rows(scans, resolver, members, progress)
    finally:
        target.close()
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


def only_problems(report: Dict[str, Any]) -> Dict[str, Any]:
    """``report`` with only its unresolved, guarded and unknown rows (``--problems``); the counts
    and the exit status stay those of the whole report."""
    rows = [r for r in report["rows"] if r["kind"] in (UNRESOLVED, GUARDED, UNKNOWN)]
    return dict(report, rows=rows, hidden=len(report["rows"]) - len(rows))


def format_text(report: Dict[str, Any]) -> str:
    """The report for people: one line per name, problems first."""
    rows = report["rows"]
    lines = [f"torchpatch check: {report['files']} files ({report['files_with_torch']} use torch), "
             f"{len(rows) + report.get('hidden', 0)} torch names, against {report['source']}"]
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
        where = f"{s['file']}:{s['line']}" if s["line"] else s["file"]  # no line: the file was not read
        lines.append(f"  skipped    {where}: {s['error']}")
    counts = report["counts"]
    summary = ", ".join(f"{counts[k]} {k}" for k in KINDS)
    if counts[PATCHED]:
        summary += " (patched names need TORCHPATCH=1 at run time)"
    if "hidden" in report:
        summary += f"; --problems: {report['hidden']} patched and native rows not shown"
    lines.append(f"{summary}; exit {report['exit']}")
    return "\n".join(lines)
