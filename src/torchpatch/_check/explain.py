"""``torchpatch explain``: what an import or attribute error about torch (or a dotted torch name)
means on one torch version: which inventoried torch versions have the name, whether a patch serves
it there (which, how, and whether the flags of this shell have it on), why it cannot be backported,
or that torchpatch does not know it.

The answer comes from the machinery of ``torchpatch check`` beside it, asked about one name: the
target torch and its view of what exists (:func:`~.target.choose_target`), the catalogue as data
(:class:`~.serving.Serving`), names resolved part by part (:class:`~.resolve.Resolver`) and members
of torch.distributed's classes (:class:`~.members.MemberChecker`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from _torchpatch_startup import parse_flag

from .. import _versions
from .._config import Config
from .._patch import Patch
from .._registry import all_patches
from .base import MISSING, MODULE, NATIVE, PATCHED, ROOT, UNKNOWN, CheckError, Result, not_backportable_for
from .inventory import Inventory, InventoryView, all_inventories, inventory_files
from .members import MemberChecker, followed
from .resolve import Resolver
from .serving import Serving
from .target import Target, choose_target

if TYPE_CHECKING:
    from .logs import LogScan

# What the query is: a dotted name, or the name an error message is about.
NAME, IMPORT, NO_MODULE, ATTRIBUTE, MEMBER = "name", "import", "module", "attribute", "member"
# The answer, and the exit status of each.
VERDICTS = {"native": 0, "served": 0, "switched off": 1, "not backportable": 1, "missing": 1, "unknown": 1,
            "known error": 1}

_MESSAGES = (
    (IMPORT, re.compile(r"cannot import name '([^']+)' from (?:partially initialized module )?'([^']+)'")),
    (NO_MODULE, re.compile(r"No module named '([^']+)'")),
    (ATTRIBUTE, re.compile(r"module '([^']+)' has no attribute '([^']+)'")),
    (MEMBER, re.compile(r"'([A-Za-z_]\w*)' object has no attribute '([^']+)'")),
    (MEMBER, re.compile(r"type object '([A-Za-z_]\w*)' has no attribute '([^']+)'")),
)
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
FORMS = """\
  ImportError: cannot import name 'Partial' from 'torch.distributed._tensor'
  ModuleNotFoundError: No module named 'torch._six'
  AttributeError: module 'torch' has no attribute 'compile'
  AttributeError: 'DeviceMesh' object has no attribute '_flatten'   (also: type object 'X' has no ...)
  torch.distributed.tensor.Partial                                  (a dotted name; a class's member too)"""


@dataclass(frozen=True)
class Query:
    form: str  # NAME, IMPORT, NO_MODULE, ATTRIBUTE or MEMBER
    name: str  # the dotted name; for MEMBER, "Class.member" with the class's bare name
    text: str  # the line it was read from


def parse(text: str) -> Query:
    """The name an error message is about (the last error in ``text``, a traceback included), or a
    dotted name; ValueError naming the accepted forms otherwise."""
    found: Optional[Tuple[int, str, "re.Match[str]"]] = None
    for form, pattern in _MESSAGES:
        for match in pattern.finditer(text):
            if found is None or match.start() > found[0]:
                found = (match.start(), form, match)
    if found is not None:
        _start, form, match = found
        line_start = text.rfind("\n", 0, match.start()) + 1
        line_end = text.find("\n", match.end())
        line = text[line_start:line_end if line_end >= 0 else len(text)].strip()
        if form == IMPORT:
            return Query(form, f"{match.group(2)}.{match.group(1)}", line)
        if form == NO_MODULE:
            return Query(form, match.group(1), line)
        return Query(form, f"{match.group(1)}.{match.group(2)}", line)
    stripped = text.strip()
    if _DOTTED.fullmatch(stripped):
        return Query(NAME, stripped, stripped)
    raise ValueError(f"cannot tell which name {text.strip()[:200]!r} is about; give an error message or a "
                     f"dotted name, one of:\n{FORMS}")


# -- resolving the query on one torch ---------------------------------------------------------------
def _classes(inv: Inventory, cls: str) -> List[str]:
    """The keys of ``inv``'s torch.distributed classes named ``cls``."""
    return [k for k in inv.classes if k.split(":", 1)[1] == cls and followed(k, inv)]


def _member(inv: Inventory, serving: Serving, cls: str, member: str) -> Result:
    """``cls.member`` where ``cls`` is the bare name of a torch.distributed class (as an
    AttributeError names it): natively, served, missing, or unknown on ``inv``'s torch."""
    if not inv.classes:
        return Result(UNKNOWN, f"{cls}.{member}", note=f"torch {inv.version} has no inventory of its classes' members")
    keys = _classes(inv, cls)
    if not keys:
        return Result(MISSING, f"{cls}.{member}", note=f"torch {inv.version} has no torch.distributed class named {cls}")
    checker = MemberChecker(inv, all_inventories(), serving)
    found = [checker.member(("inst", key.replace(":", ".")), member) for key in keys]
    for status in (NATIVE, PATCHED, MISSING):
        for result in found:
            if result is not None and result.status == status:
                return result
    return Result(UNKNOWN, f"{keys[0].replace(':', '.')}.{member}",
                  note=f"no inventoried torch's {cls} has a class-level member {member} (an attribute an "
                  "instance sets is not recorded)")


def _resolve(query: Query, version: str, view: Any, inv: Inventory, serving: Serving, shim_view: Any = None) -> Result:
    """What ``query`` is on one torch: a :class:`Result` whose key is the (full) name it is about."""
    if query.form == MEMBER:
        cls, member = query.name.split(".", 1)
        return _member(inv, serving, cls, member)
    if query.name != ROOT and not query.name.startswith(ROOT + "."):
        return Result(UNKNOWN, query.name, note="torchpatch serves torch's names only")
    result = Resolver(view, version, serving, shim_view).resolve(query.name)
    if result.status in (NATIVE, PATCHED) and result.key != query.name:  # Class.member: a member of what it reaches
        member = query.name[len(result.key) + 1:].split(".", 1)[0]
        found = MemberChecker(inv, all_inventories(), serving).member(("name", result.key), member)
        leaf = result.key.rsplit(".", 1)[1]
        if found is None and _classes(inv, leaf):  # a class this torch has elsewhere (served under this name)
            found = _member(inv, serving, leaf, member)
        if found is None or found.status == UNKNOWN:
            return Result(UNKNOWN, f"{result.key}.{member}", result.patches, result.how,
                              f"{result.key} is there; members are known for torch.distributed's classes only, "
                              "and only class-level ones")
        served = PATCHED in (result.status, found.status) and found.status != MISSING
        return Result(PATCHED if served else found.status, found.key, result.patches + found.patches,
                      result.how + found.how, found.note)
    return result


def _mechanisms(patch: Patch, how: Sequence[str], version: str, inv: Inventory) -> List[str]:
    """How ``patch`` serves what ``how`` (the resolver's words, one per name served on the way) says
    it serves: module shim, alias, symbol, a name or member a hook sets, a name a shim module holds."""
    out: List[str] = []
    for text in how:
        out += [f"module shim {m}" for m in patch.modules if text.startswith(f"module {m} served by {patch.id}")]
        out += [f"alias: {a} is the module {t}" for a, t, spec in patch.aliases if text == f"{a} = {t} ({patch.id})"]
        out += [f"symbol {m}.{n}, made on first use" for m, n in patch.symbols
                if text.startswith(f"{m}.{n} served by {patch.id}")]
        for m, n, spec in patch.hook_symbols:
            if _versions.matches(spec, version) and text.startswith(f"{m}.{n} served by {patch.id}"):
                module, _, cls = m.rpartition(".")
                if m in patch.modules:
                    out.append(f"{m}.{n}, a name its shim module holds")
                else:
                    out.append(f"{'member' if f'{module}:{cls}' in inv.classes else 'name'} {m}.{n}, set by a hook")
        if f" found by building {patch.id}'s shim" in text:
            out.append(f"{text.split(' ', 1)[0]}, a name its shim module holds")
    return list(dict.fromkeys(out))


@dataclass
class _Answer:
    """A verdict, the result it rests on, and the patches that serve the name (or would, if on)."""

    verdict: str
    result: Result
    patches: List[str]


def _verdict(query: Query, target: Target, patches: Sequence[Patch], cfg: Config) -> Tuple[_Answer, Serving]:
    """The verdict on ``target`` with this shell's switches, and what the catalogue serves there."""
    serving = Serving.for_torch(target.version, patches, cfg)
    result = _resolve(query, target.version, target.view, target.inventory, serving, target.shim_view)
    if result.status == NATIVE:
        return _Answer("native", result, []), serving
    if result.status == PATCHED:
        return _Answer("served", result, list(result.patches)), serving
    entry = not_backportable_for(result.key)
    if entry and not _versions.matches(entry["torch"], target.version):
        return _Answer("not backportable", result, []), serving
    if result.status == MISSING:
        everything = Serving.for_torch(target.version, patches, Config())
        anyway = _resolve(query, target.version, target.view, target.inventory, everything, target.shim_view)
        if anyway.status == PATCHED:
            return _Answer("switched off", anyway, list(anyway.patches)), serving
        return _Answer("missing", result, []), serving
    return _Answer("unknown", result, []), serving


def _across_inventories(query: Query, patches: Sequence[Patch], cfg: Config) -> Dict[str, str]:
    """Inventoried torch version -> NATIVE, PATCHED, MISSING or UNKNOWN, from the inventories alone."""
    inventories = all_inventories()
    out = {}
    for inv in inventories:
        serving = Serving.for_torch(inv.version, patches, cfg)
        out[inv.version] = _resolve(query, inv.version, InventoryView(inv, inventories), inv, serving).status
    return out


def explain(query: Query, target: Target, patches: Optional[Sequence[Patch]] = None,
            cfg: Optional[Config] = None, note: str = "") -> Dict[str, Any]:
    """The answer about ``query`` on ``target``, as a JSON-ready dict (``exit``: its exit status). The
    target stays open (a log asks it about each name it holds): whoever chose it closes it."""
    cfg = cfg or Config.from_environ()
    patches = all_patches() if patches is None else patches
    by_id = {p.id: p for p in patches}
    answer, serving = _verdict(query, target, patches, cfg)
    submodule = answer.verdict == "native" and query.form == ATTRIBUTE and _is_module(target, answer.result.key)
    result = answer.result
    everywhere = _across_inventories(query, patches, cfg)
    served_by = [{
        "patch": pid,
        "how": _mechanisms(by_id[pid], result.how, target.version, target.inventory),
        "enabled": serving.decisions[pid].enabled if pid in serving.decisions else False,
        "reason": serving.decisions[pid].reason if pid in serving.decisions else "",
    } for pid in dict.fromkeys(answer.patches) if pid in by_id]
    native_in = [v for v, status in everywhere.items() if status == NATIVE]
    served_in = [v for v, status in everywhere.items() if status == PATCHED]
    verdict = answer.verdict
    cut = query.form != MEMBER and result.key != query.name and result.status in (MISSING, UNKNOWN)
    notes = [n for n in (note, f"{result.key} is missing" if cut and result.status == MISSING else "", result.note) if n]
    if submodule:
        notes.append(f"{result.key} is a module: `import {result.key}` before using it as an attribute "
                     "(a package does not import its submodules by itself)")
    if verdict == "missing" and not native_in and not served_in:
        verdict = "unknown"
        notes.append("no inventoried torch has it, and no patch serves it on any: a typo, or not a name of torch?")
    return {
        "query": query.text,
        "form": query.form,
        "name": query.name if cut else result.key,
        "torch": target.version,
        "installed": target.installed,
        "source": target.source,
        "verdict": verdict,
        "served_by": served_by,
        "how": list(result.how),
        "notes": notes,
        "not_backportable": not_backportable_for(result.key) if verdict == "not backportable" else None,
        "native_in": native_in,
        "served_in": served_in,
        "torchpatch_on": parse_flag(os.environ.get("TORCHPATCH", "")) is True,
        "exit": VERDICTS[verdict],
    }


def _is_module(target: Target, name: str) -> bool:
    parent, _, leaf = name.rpartition(".")
    return bool(parent) and target.view.child(parent, leaf)[0] == MODULE


# -- the command -------------------------------------------------------------------------------------
def format_text(report: Dict[str, Any]) -> str:
    """The answer for people."""
    verdict, name, torch = report["verdict"], report["name"], report["torch"]
    lines = [f"torchpatch explain: {name}", f"  read from    {report['query']}" if report["form"] != NAME else "",
             f"  on torch     {report['source']}"]
    if verdict == "native":
        lines.append(f"  native       torch {torch} has it" + ("" if report["form"] == NAME else (
            ": the error comes from elsewhere (another torch first on sys.path, a name your code shadows, "
            "a module not imported yet)")))
    elif verdict == "served":
        for s in report["served_by"]:
            lines.append(f"  served       by {s['patch']}: {'; '.join(s['how']) or 'declared'}")
            lines.append(f"               {s['patch']} is on here ({s['reason']}); it acts in processes started with "
                         "TORCHPATCH=1" + ("" if report["torchpatch_on"] else ", which this shell does not set"))
    elif verdict == "switched off":
        for s in report["served_by"]:
            lines.append(f"  switched off {s['patch']} would serve it ({'; '.join(s['how']) or 'declared'}) but is off "
                         f"here: {s['reason']}")
    elif verdict == "not backportable":
        entry = report["not_backportable"]
        lines.append(f"  not backportable: {entry['what']} needs torch {entry['torch']}: {entry['why']}")
    elif verdict == "missing":
        lines.append(f"  missing      torch {torch} lacks it and no patch serves it there")
    else:
        lines.append(f"  unknown      torchpatch does not know {name} on torch {torch}")
    lines += [f"  note         {n}" for n in report["notes"]]
    lines.append("  native in    " + (", ".join(report["native_in"]) or "no inventoried torch"))
    if report["served_in"]:
        lines.append("  served in    " + ", ".join(report["served_in"]) + " (with TORCHPATCH=1 and this shell's switches)")
    lines.append(f"{verdict}; exit {report['exit']}")
    return "\n".join(line for line in lines if line)


HELP = f"""\
Explain an ImportError, ModuleNotFoundError or AttributeError about torch, or a dotted torch name:
which inventoried torch versions have it, whether a patch of the catalogue serves it on the chosen
torch (which patch; how: module shim, alias, symbol, or a name or member a hook sets; whether this
shell's TORCHPATCH_* variables have that patch on), or why it cannot be backported. Accepted:

{FORMS}

An error a patch fixes (its Patch(errors=...): `Cannot use ReduceOp.AVG with Gloo`, `cannot pickle
'...ProcessGroup' object`, ...) names that patch and whether it acts on the chosen torch: on (exit 0),
switched off by a flag, or for other torch versions (exit 1). Known errors no patch makes go away (patches/_data/known_errors.json: torch 2.4's `2D state_dict is
under development`, `Weights only load failed`, DCP's `Missing key in checkpoint state_dict`, DTensor's
`in-place operations that require placement changes`, ...) get their meaning, a one-line remedy and
the upstream link. A message with several lines: the last error in it counts.

A whole log: `-` (standard input) or a file's PATH. It is read in blocks (fast on a log of 100 MB,
nothing in it is run), rank prefixes ([rank1]:, [default1]:, srun's `1: ` and `srun:`) are stripped,
and every distinct known error is explained once, with its first line, how often and which ranks
printed it; the other error lines are listed as not known:
  python train.py 2>&1 | torchpatch explain -
  torchpatch explain job.log --json

--torch: the installed torch by default (its inventory, and a helper that imports it for what the
inventory cannot say); where torch is not installed, the newest inventoried torch. Members are known
for torch.distributed's classes (the inventories record their class-level members).

Verdicts of a message: native, served, fixed here (exit 0); switched off, not backportable, missing,
unknown, not for this torch, known error (exit 1). A log: exit 0 once it was read (empty, binary or without known errors too).
Exit 2: a usage error (a message it cannot read, an unreadable PATH, an unknown --torch).
"""


def register(sub: Any) -> None:
    """Add ``explain`` to the CLI's subcommands."""
    p = sub.add_parser("explain", help="what an ImportError/AttributeError about torch or a known error means (which"
                       " torch has the name, which patch serves it, the remedy); every one in a whole log", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("message", metavar="MESSAGE", help="an error message, a dotted name, or a log: - (stdin) or a file's PATH")
    p.add_argument("--torch", metavar="VERSION", help="explain for this torch: X.Y.Z, or X.Y for the newest inventoried"
                   f" X.Y.*; inventoried: {', '.join(inventory_files())}")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _known(scanned: "LogScan", requested: Optional[str], cfg: Config) -> Optional[Dict[str, Any]]:
    """The answer about the last known error (or error a patch fixes) of a message (``scanned``: its
    lines, what they name collected from all of them) on the torch ``requested`` (None: the installed
    one), or None."""
    from .fixes import report_for
    from .logs import known_errors_by_id

    found = [f for f in scanned.found.values() if f.kind == "known"]
    if not found:
        return None
    version = _target_version(requested)
    line = max(f.first_line for f in found)
    by_id = known_errors_by_id()
    # of the entries the last such line matches (two patches may fix one error), one that applies here first
    last = sorted([f for f in found if f.first_line == line],
                  key=lambda f: not _versions.matches(by_id[f.key]["torch"] or ">=0", version))[0]
    return report_for(by_id[last.key], last.details, version, last.text, all_patches(), cfg)


def _target_version(requested: Optional[str]) -> str:
    """The torch version a known error is answered for (no helper process needed)."""
    target = choose_target(requested, live=False)
    target.close()
    return target.version


def run(args: argparse.Namespace) -> int:
    note = ""
    requested = args.torch
    if requested is None and _versions.torch_version() is None:
        requested = list(inventory_files())[-1]
        note = f"torch is not installed here: answering for the newest inventoried torch, {requested} (--torch to choose)"
    if os.sep in args.message and os.path.isdir(args.message):
        print(f"torchpatch explain: {args.message} is a directory: give a log file, - for standard input, or a "
              "message", file=sys.stderr)
        return 2
    if args.message == "-" or (os.path.exists(args.message) and not os.path.isdir(args.message)):
        from .logs import run_log  # a log: a file, or a pipe (<(command), /dev/stdin)

        return run_log(args, requested, note)
    text = os.fsencode(args.message).decode(sys.getfilesystemencoding(), "replace")  # never surrogate escapes
    from .logs import scan

    scanned = scan(io.BytesIO(text.encode("utf-8", "replace")))  # its lines, read as a log's
    try:
        known = _known(scanned, requested, Config.from_environ())  # a known error, or one a patch fixes, first
        if known is not None:
            if note:
                known["notes"] = [note]
            print(json.dumps(known, indent=2) if args.json else "\n".join(_format_known(known)))
            return int(known["exit"])
        try:
            query = parse(text)
        except ValueError:
            if os.sep in text and "\n" not in text.strip():
                raise ValueError(f"no such file: {text.strip()[:200]!r} (a log to read?), nor an error message "
                                 f"it can read, one of:\n{FORMS}") from None
            return _unknown_error(text, scanned, requested, note, args.json)
        target = choose_target(requested, live=True)
        try:
            report = explain(query, target, note=note)
        finally:
            target.close()
    except (ValueError, CheckError) as exc:
        print(f"torchpatch explain: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return int(report["exit"])


def _unknown_error(text: str, scanned: "LogScan", requested: Optional[str], note: str, as_json: bool) -> int:
    """An error message torchpatch does not know (exit 0: it was read), answered as a one-message log
    (``scanned``: its lines); text with no error line in it is a usage error (exit 2)."""
    from .logs import explain_log, format_log

    if not scanned.unrecognised:
        raise ValueError(f"cannot tell which name {text.strip()[:200]!r} is about; give an error message or a "
                         f"dotted name (or a log: - or PATH), one of:\n{FORMS}")
    report = explain_log(scanned, "the message", requested, note)
    print(json.dumps(report, indent=2) if as_json else format_log(report))
    return 0


def _format_known(report: Dict[str, Any]) -> List[str]:
    from .logs import format_known

    return format_known(report) + [f"  note         {n}" for n in report.get("notes", [])] + [
        f"{report['verdict']}; exit {report['exit']}"]
