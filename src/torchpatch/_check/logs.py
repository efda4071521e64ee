"""``torchpatch explain -`` and ``torchpatch explain PATH``: every distinct error a whole log holds that
torchpatch knows (a missing torch name, or an entry of ``patches/_data/known_errors.json``), found by
reading the log line by line (never running anything from it), once each however many ranks printed it.

Rank prefixes are stripped before matching: torchrun's ``[rank1]:`` and ``[default1]:``, SLURM's
``srun --label`` ``1: `` and ``srun:`` lines, nested (``0: [rank3]:``); the rank is the innermost
number. The log is read :data:`BLOCK` bytes at a time, so a log without newlines (or binary data) never
sits in memory whole.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import IO, Any, Dict, List, Optional, Pattern, Tuple

from .. import _versions
from .._registry import catalogue_data
from .fixes import PATCH_ERROR, format_fix

BLOCK = 1 << 22  # bytes read at a time (whole lines; a longer line is cut there)
SNIFF = 1 << 16  # a NUL byte in the first bytes: binary data
MAX_DETAILS = 20  # distinct details (globals, keys) kept per known error
MAX_UNRECOGNISED = 20  # distinct error lines torchpatch does not know, kept in order of appearance

_PREFIX = re.compile(r"(?:[ \t]*(?:\[(?:rank|default)?(\d+)\]:|(\d{1,6}):(?=[ \t])|srun:(?=[ \t])))+[ \t]?")
# an exception's last line: `ValueError: ...`, `torch.distributed.DistBackendError: ...`, `_pickle.UnpicklingError`
_ERROR_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)(?::|$)")
# where such a line may be: each word alone, as literal text (fast), then the line is read
_ERROR_WORDS = tuple(re.compile(word + r"(?::|$)", re.M) for word in ("Error", "Exception", "Interrupt"))


@functools.lru_cache(maxsize=None)
def known_errors() -> Tuple[Dict[str, Any], ...]:
    """The entries of ``patches/_data/known_errors.json``, then one per patch with ``errors``
    (:func:`~.fixes.fix_entries`)."""
    from .fixes import fix_entries

    return tuple(json.loads((catalogue_data() / "known_errors.json").read_text())["entries"]) + fix_entries()


@functools.lru_cache(maxsize=None)
def _compiled() -> Tuple[Tuple[Pattern[str], ...], Tuple[Tuple[str, Pattern[str]], ...]]:
    """(the patterns run over a whole block, one at a time: an alternation of them would try each at
    every position, many times slower than each alone with its literal text; each entry's own patterns)."""
    from .explain import _MESSAGES

    own = tuple((e["id"], re.compile(p)) for e in known_errors() for p in e["patterns"])
    triggers = tuple(re.compile(p.pattern, re.M) for p in [p for _, p in _MESSAGES] + [p for _, p in own])
    return triggers, own


def known_error_matches(line: str) -> List[Tuple[Dict[str, Any], Optional[str]]]:
    """The known-error entries ``line`` matches, each with what its ``detail`` group names (or None)."""
    by_id = known_errors_by_id()
    out = []
    for entry_id, pattern in _compiled()[1]:
        match = pattern.search(line)
        if match:
            out.append((by_id[entry_id], match.groupdict().get("detail")))
    return out


@functools.lru_cache(maxsize=None)
def known_errors_by_id() -> Dict[str, Dict[str, Any]]:
    """:func:`known_errors` by their ``id``."""
    return {e["id"]: e for e in known_errors()}


def strip_prefix(line: str) -> Tuple[Optional[int], str]:
    """``(rank, text)``: the line without its rank prefixes; the rank is the innermost one's (None: none)."""
    match = _PREFIX.match(line)
    if not match or not match.end():
        return None, line
    ranks = [a or b for a, b in _PREFIX_NUMBERS.findall(match.group(0))]
    return (int(ranks[-1]) if ranks else None), line[match.end():]


_PREFIX_NUMBERS = re.compile(r"\[(?:rank|default)?(\d+)\]:|(\d{1,6}):")


@dataclass
class Finding:
    """One distinct error of the log: where it first appears, how often, which ranks printed it."""

    kind: str  # "name" (a missing torch name: the text is what explain.parse reads) or "known" (key: the entry id)
    key: str
    text: str  # its first line, prefixes stripped
    first_line: int
    count: int = 0
    ranks: List[int] = field(default_factory=list)
    details: List[str] = field(default_factory=list)

    def seen(self, rank: Optional[int], detail: Optional[str] = None) -> None:
        self.count += 1
        if rank is not None and rank not in self.ranks:
            self.ranks.append(rank)
        if detail and detail not in self.details and len(self.details) < MAX_DETAILS:
            self.details.append(detail)

    def as_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "text": self.text, "first_line": self.first_line,
                "count": self.count, "ranks": sorted(self.ranks), "details": self.details}


@dataclass
class LogScan:
    """What a log holds: its size, whether it is binary, the known errors and the unrecognised ones."""

    bytes: int = 0
    lines: int = 0
    binary: bool = False
    found: Dict[Tuple[str, str], Finding] = field(default_factory=dict)
    unrecognised: Dict[str, Finding] = field(default_factory=dict)
    torch_in_log: Optional[str] = None  # the torch torchpatch's summary line in the log names


_SUMMARY = re.compile(r"torchpatch: \S+ on torch (\d+\.\d+(?:\.\d+)?)")


def scan(stream: IO[bytes]) -> LogScan:
    """Read ``stream`` in blocks of whole lines and collect every distinct error torchpatch knows: the
    patterns run over each block at once, the lines they hit are then read one by one."""
    triggers, _own = _compiled()
    out = LogScan()
    rest = b""
    number = 0  # lines before the block
    unfinished = False  # the last block ended inside a line
    while True:
        chunk = stream.read(BLOCK)
        if not chunk and not rest:
            break
        if not out.bytes and b"\0" in chunk[:SNIFF]:
            out.binary = True
        out.bytes += len(chunk)
        data = rest + chunk
        cut = data.rfind(b"\n") + 1 if chunk else len(data)  # whole lines; at the end, all that is left
        if not cut:  # no newline yet: wait for one, up to a block's worth (then a huge line is cut there)
            if len(data) < BLOCK:
                rest = data
                continue
            cut = len(data)
        block, rest = data[:cut].decode("utf-8", "replace"), data[cut:]
        _scan_block(out, triggers, block, number)
        number += block.count("\n")  # a line cut at a block's end goes on in the next block
        unfinished = not block.endswith("\n")
    out.lines = number + unfinished
    return out


def _scan_block(out: LogScan, triggers: Tuple[Pattern[str], ...], block: str, number: int) -> None:
    """The errors in ``block`` (whole lines; the first is line ``number + 1`` of the log)."""
    hits: Dict[int, bool] = {}  # where a line with a hit starts -> whether a known error's pattern hit it
    for known, patterns in ((True, triggers), (False, _ERROR_WORDS)):
        for pattern in patterns:
            for match in pattern.finditer(block):
                start = block.rfind("\n", 0, match.start()) + 1
                hits[start] = hits.get(start, False) or known
    if out.torch_in_log is None and "torchpatch: " in block:
        summary = _SUMMARY.search(block)
        out.torch_in_log = summary.group(1) if summary else None
    counted, line_no = 0, number + 1
    for start in sorted(hits):
        line_no += block.count("\n", counted, start)
        counted = start
        end = block.find("\n", start)
        rank, text = strip_prefix(block[start:end if end >= 0 else len(block)].rstrip("\r"))
        if hits[start]:
            if _record(out, text, rank, line_no):
                continue
        if _ERROR_LINE.match(text):
            key = text.strip()[:300]
            finding = out.unrecognised.get(key)
            if finding is None and len(out.unrecognised) < MAX_UNRECOGNISED:
                finding = out.unrecognised[key] = Finding("unrecognised", key, key, line_no)
            if finding is not None:
                finding.seen(rank)


@functools.lru_cache(maxsize=4096)  # the same error line, printed by every rank and every step, is read once
def _classify(text: str) -> Tuple[Tuple[str, str, str, Optional[str]], ...]:
    """``(kind, key, text, detail)`` of each known error one line (prefixes stripped) holds."""
    from .explain import parse

    matched = known_error_matches(text)
    if matched:
        return tuple(("known", entry["id"], text.strip(), detail) for entry, detail in matched)
    try:
        query = parse(text)
    except ValueError:
        return ()
    return (("name", query.name, query.text, f"{query.form}:{query.name}"),)


def _record(out: LogScan, text: str, rank: Optional[int], number: int) -> bool:
    """Add the known errors of one line (prefixes stripped) to ``out``; whether it had one."""
    found = _classify(text)
    for kind, key, shown, detail in found:
        if kind == "known":
            out.found.setdefault((kind, key), Finding(kind, key, shown, number)).seen(rank, detail)
        else:  # a name: the form and the name tell one from another
            out.found.setdefault((kind, str(detail)), Finding(kind, key, shown, number)).seen(rank)
    return bool(found)


def known_report(entry: Dict[str, Any], details: List[str], torch: str, text: str,
                 patches: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The answer about a known error on ``torch``, as a JSON-ready dict."""
    raises_here = entry["torch"] is None or _versions.matches(entry["torch"], torch)
    return {
        "query": text,
        "form": "known error",
        "id": entry["id"],
        "torch": torch,
        "raised_on": entry["torch"] or "any torch",
        "raised_here": raises_here,
        "verdict": "known error",
        "meaning": entry["meaning"],
        "remedy": entry["remedy"],
        "upstream": entry["upstream"],
        "details": details,
        "patches": patches,
        "patch_note": entry.get("patch_note"),
        "exit": 1,
    }


def format_known(report: Dict[str, Any], indent: str = "") -> List[str]:
    """The lines for people about one known error (or an error a patch fixes)."""
    if report["form"] == PATCH_ERROR:
        return format_fix(report, indent)
    lines = [f"torchpatch explain: a known error ({report['id']})", f"  read from    {report['query'][:300]}",
             f"  on torch     {report['torch']}" + ("" if report["raised_here"] else
                                                   f" (torch raises it on {report['raised_on']}, not here)"),
             f"  meaning      {report['meaning']}"]
    if report["details"]:
        lines.append(f"  it names     {', '.join(report['details'])}")
    lines.append(f"  remedy       {report['remedy']}")
    for patch in report["patches"]:
        lines.append(f"  patch        {patch['patch']}: {patch['state']}")
    if report["patch_note"]:
        lines.append(f"  torchpatch   {report['patch_note']}")
    lines.append(f"  upstream     {report['upstream']}")
    return [indent + line for line in lines]


def _ranks(ranks: List[int]) -> str:
    """``0-3, 5``: the ranks that printed an error."""
    spans: List[List[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _where(finding: Dict[str, Any]) -> str:
    ranks = f", rank{'s' if len(finding['ranks']) > 1 else ''} {_ranks(finding['ranks'])}" if finding["ranks"] else ""
    times = f", {finding['count']} times" if finding["count"] > 1 else ""
    return f"line {finding['first_line']}{ranks}{times}"


def explain_log(found: LogScan, source: str, requested: Optional[str], note: str = "") -> Dict[str, Any]:
    """The answer about a whole log, as a JSON-ready dict: each distinct known error explained once."""
    from .._config import Config
    from .._registry import all_patches
    from .explain import _target_version, explain, parse
    from .fixes import report_for
    from .target import Target, choose_target

    cfg = Config.from_environ()
    patches = all_patches()
    version = _target_version(requested)
    by_id = known_errors_by_id()
    errors = []
    target: Optional[Target] = None  # chosen at the first missing name, asked about each, then closed
    try:
        for finding in sorted(found.found.values(), key=lambda f: f.first_line):
            if finding.kind == "known":
                report = report_for(by_id[finding.key], finding.details, version, finding.text, patches, cfg)
            else:
                target = target or choose_target(requested, live=True)
                report = explain(parse(finding.text), target, patches, cfg)
            errors.append(dict(finding.as_dict(), explanation=report))
    finally:
        if target is not None:
            target.close()
    notes = [note] if note else []
    if found.torch_in_log and requested is None and found.torch_in_log != version:
        notes.append(f"the log's torchpatch summary line names torch {found.torch_in_log}: --torch "
                     f"{found.torch_in_log} answers for it")
    if found.binary:
        notes.append("binary data (NUL bytes), not a text log" + ("" if errors else ": no error message read in it"))
    elif not found.bytes:
        notes.append("the log is empty")
    return {
        "log": source,
        "bytes": found.bytes,
        "lines": found.lines,
        "binary": found.binary,
        "torch": version,
        "errors": errors,
        "unrecognised": [f.as_dict() for f in found.unrecognised.values()],
        "notes": notes,
        "exit": 0,
    }


def format_log(report: Dict[str, Any]) -> str:
    """The answer about a log, for people."""
    errors, unknown = report["errors"], report["unrecognised"]
    lines = [f"torchpatch explain: {report['log']}: {_count(report['lines'], 'line')}, "
             f"{_count(len(errors), 'known error')}, {_count(len(unknown), 'other error line')} (torch {report['torch']})"]
    lines += [f"  note         {n}" for n in report["notes"]]
    for number, error in enumerate(errors, 1):
        lines.append(f"[{number}] {_where(error)}: {error['text'][:300]}")
        explanation = error["explanation"]
        if error["kind"] == "known":
            body = format_known(explanation, "    ")
        else:
            from .explain import format_text

            body = ["    " + line for line in format_text(explanation).splitlines()[:-1]]
        lines += body
    if unknown:
        lines.append("errors torchpatch does not know (first line of each, as printed):")
        lines += [f"  {_where(f)}: {f['text'][:300]}" for f in unknown]
    if not errors and not unknown and not report["binary"] and report["bytes"]:
        lines.append("no error message in it")
    lines.append(f"exit {report['exit']}")
    return "\n".join(lines)


def run_log(args: Any, requested: Optional[str], note: str) -> int:
    """``torchpatch explain -`` / ``PATH``: read the log, print the answer; 0 once the log was read."""
    import sys

    from .base import CheckError

    source = "standard input" if args.message == "-" else args.message
    try:
        if args.message == "-":
            found = scan(sys.stdin.buffer)
        else:
            with open(args.message, "rb") as stream:
                found = scan(stream)
        report = explain_log(found, source, requested, note)
    except OSError as exc:
        print(f"torchpatch explain: cannot read {source}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (ValueError, CheckError) as exc:
        print(f"torchpatch explain: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_log(report))
    return 0
