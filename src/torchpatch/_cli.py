"""The ``torchpatch`` command (also ``python -m torchpatch``)."""

from __future__ import annotations

import argparse
import json
import os
import site
import sys
from typing import Any, Dict, List, Optional, Sequence

from _torchpatch_startup import parse_flag

from . import _versions
from ._config import Config
from ._known_bugs import known_bugs_for
from ._manager import PatchPlan, __version__, plan
from ._patch import Patch

DESCRIPTION = """\
Run distributed PyTorch code on the torch you have, with zero code changes.

torchpatch is off unless TORCHPATCH=1 (or 1/true/yes/on, any case) is set; then every Python
process (torchrun's workers included) serves missing torch modules and symbols and fixes known
behaviours as each torch module is imported:

    TORCHPATCH=1 torchrun --nproc_per_node 8 train.py

Environment:
  TORCHPATCH=1                turn torchpatch on for every process started with it
  TORCHPATCH_DISABLE=a,b      turn these patch ids off ('*' = all)
  TORCHPATCH_ENABLE=a,b       turn on only these patch ids (and what they need)
  TORCHPATCH_<ID>=0|1         one patch off/on, e.g. TORCHPATCH_PROCESSGROUP_DEEPCOPY=0
  TORCHPATCH_STRICT=1         a patch that fails while applying raises instead of being skipped
  TORCHPATCH_LOG=LEVEL        debug | info (default: one summary line, rank 0) | warning | off
  TORCHPATCH_REPORT=DIR       at exit, each process that activated writes DIR/torchpatch-<host>-<rank>-<pid>.json:
                              its rank, versions, each patch's status (and error), what it used
"""


def _installed_startup_hooks() -> List[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [os.path.join(d, "torchpatch.pth") for d in dirs if os.path.exists(os.path.join(d, "torchpatch.pth"))]


def _dist_version(name: str) -> Optional[str]:
    if sys.version_info >= (3, 10):
        from importlib import metadata
    else:
        import importlib_metadata as metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _hazards(torch: Optional[str]) -> List[str]:
    found = []
    numpy = _dist_version("numpy")
    if torch and numpy and _versions.matches("<2.3", torch) and _versions.matches(">=2", numpy):
        found.append(
            f"numpy {numpy} beside torch {torch}, which was built against numpy 1.x: torch.from_numpy"
            " and friends fail ('_ARRAY_API not found'); install 'numpy<2'"
        )
    return found


def _untested(torch: Optional[str], newest: str, plans: List[PatchPlan]) -> List[str]:
    """A warning where ``torch`` is newer than ``newest``, the newest torch the catalogue was tested
    on: every patch that applies to it has an open-ended version range."""
    if not _versions.matches(f">{newest}", torch):
        return []
    applying = ", ".join(p.patch.id for p in plans if p.applies) or "none"
    return [f"torch {torch} is newer than the newest torch this catalogue was tested on ({newest}):"
            f" the patches whose version range is open-ended apply untested ({applying})"]


def _not_backportable(torch: Optional[str], patches: Sequence[Patch] = (), cfg: Optional[Config] = None) -> List[Dict[str, str]]:
    """Features this torch lacks that torchpatch cannot serve (patches/not_backportable.json), less
    those a catalogue patch serves on this torch (switched on or not)."""
    from ._check import not_backportable
    from ._check.serving import Serving

    missing = [e for e in not_backportable() if torch and not _versions.matches(e["torch"], torch)]
    if not missing or not patches:
        return missing
    serving = Serving.for_torch(torch, patches, cfg or Config.from_environ())
    served = set(serving.shims) | set(serving.aliases) | set(serving.off)
    served |= {f"{module}.{name}" for module, name in serving.symbols}
    return [e for e in missing if e["name"] not in served]


def _plan_rows(plans: List[PatchPlan]) -> List[Dict[str, Any]]:
    return [
        {
            "id": p.patch.id,
            "summary": p.patch.summary,
            "category": p.patch.category,
            "torch": p.patch.torch,
            "applies": p.applies,
            "applies_reason": p.applies_reason,
            "enabled": p.decision.enabled,
            "enabled_reason": p.decision.reason,
            "active": p.active,
            "provides": p.patch.provides,
            "upstream": p.patch.upstream,
        }
        for p in plans
    ]


def cmd_list(args: argparse.Namespace) -> int:
    rows = _plan_rows(plan())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    torch = _versions.torch_version()
    print(f"torchpatch {__version__}, torch {torch or '(not installed)'}; patches:")
    width = max([len(r["id"]) for r in rows] + [2])
    for r in rows:
        applies = "applies" if r["applies"] else f"n/a ({r['applies_reason']})"
        state = ("on" if r["enabled"] else "off") + f" ({r['enabled_reason']})"
        tag = " [silent wrong results]" if r["category"] == "correctness" else ""
        print(f"  {r['id']:<{width}}  {applies}; {state}{tag}\n  {'':<{width}}  {r['summary']}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .patches import NEWEST_TESTED_TORCH

    cfg = Config.from_environ()
    plans = plan(cfg=cfg)
    torch = _versions.torch_version()
    report = {
        "torchpatch": __version__,
        "python": _versions.python_version(),
        "executable": sys.executable,
        "torch": torch,
        "wrapt": _dist_version("wrapt"),
        "numpy": _dist_version("numpy"),
        "startup_hook": _installed_startup_hooks(),
        "flags": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHPATCH")},
        "strict": cfg.strict,
        "log_level": cfg.log_level,
        "would_apply": [p.patch.id for p in plans if p.active],
        "switched_off": {p.patch.id: p.decision.reason for p in plans if p.applies and not p.decision.enabled},
        "newest_tested_torch": NEWEST_TESTED_TORCH,
        "warnings": cfg.warnings + _untested(torch, NEWEST_TESTED_TORCH, plans),
        "hazards": _hazards(torch),
        "not_backportable": _not_backportable(torch, [p.patch for p in plans], cfg),
        "silent_bugs": known_bugs_for(torch, plans, parse_flag(os.environ.get("TORCHPATCH", "0")) is True),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    hook = ", ".join(report["startup_hook"]) or "NOT FOUND (use `torchpatch run -- CMD`, or sitecustomize_example.py)"
    lines = [
        f"torchpatch   {__version__}",
        f"python       {report['python']} ({sys.executable})",
        f"torch        {torch or 'not installed'}",
        f"wrapt        {report['wrapt']}",
        f"numpy        {report['numpy'] or 'not installed'}",
        f"start-up     {hook}",
        "flags        " + (" ".join(f"{k}={v}" for k, v in report["flags"].items()) or "none (torchpatch is off)"),
        "would apply  " + (", ".join(report["would_apply"]) or "nothing"),
    ]
    lines += [f"switched off {k}: {v}" for k, v in report["switched_off"].items()]
    lines += [f"warning      {w}" for w in report["warnings"]]
    lines += [f"HAZARD       {h}" for h in report["hazards"]] or ["hazards      none found"]
    lines += [f"not here     {e['what']}: {e['name']} needs torch {e['torch']} (cannot be backported)"
              for e in report["not_backportable"]]
    lines += [(f"silent bug   fixed: {b['id']}" if b["fixed"] else f"SILENT BUG   NOT FIXED: {b['id']}")
              + f" (torch {b['torch']}): {b['what']}; {b['why']}; {b['upstream']}" for b in report["silent_bugs"]]
    if torch and not report["silent_bugs"]:
        lines.append(f"silent bugs  none known for torch {torch}")
    print("\n".join(lines))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("torchpatch run: give the command to run, e.g. torchpatch run -- torchrun train.py", file=sys.stderr)
        return 2
    bootstrap = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
    env = dict(os.environ, TORCHPATCH="1")
    env["PYTHONPATH"] = os.pathsep.join([bootstrap] + [p for p in [env.get("PYTHONPATH")] if p])
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"torchpatch run: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127


CHECK_HELP = """\
Scan PATH... (directories: every .py file, hidden directories and virtual environments skipped) for
the torch names the code uses, without running it: `import torch.x.y`, `from torch.x import a`,
attribute chains on imported torch modules (`dist.fsdp.fully_shard`), `torch.ops.<ns>.<op>`; and the
members used on values of torch.distributed's classes where the code makes the class evident (`mesh =
init_device_mesh(...)`, `mesh["dp"]`, `def f(mesh: DeviceMesh)`, inside `if isinstance(x, DTensor):`),
with the calls of those classes checked against their __init__ (`DeviceMesh.get_local_rank`,
`PipelineStage.__init__`). Each distinct name gets one row:

  native      the torch checked against has it
  patched     torchpatch serves it there (the patch is named; needs TORCHPATCH=1 at run time)
  unresolved  missing there: the import or attribute access fails (the torch versions that have
              it are listed, and features that cannot be backported are named)
  guarded     missing, but only used under an import guard, so the code takes its fallback:
              inside try/except ImportError/ModuleNotFoundError/AttributeError/Exception (or
              contextlib.suppress), an except-branch whose try-branch resolves, or under an `if`
              (or `x if ... else y`, `a and b`) whose test uses hasattr/getattr/find_spec, a
              name with "version" in it (torch.__version__, TORCH_VERSION), TYPE_CHECKING or a
              TORCH_GE_2_4-like flag; annotations under `from __future__ import annotations`
  unknown     cannot be decided without that torch at hand (outside its inventory, operators of
              an uninstalled torch, a module that fails to import)

Against the installed torch (default), what exists comes from its inventory in the catalogue when
there is one, and otherwise from a helper interpreter that imports torch once, with torchpatch off
(--no-import: never; those names stay unknown). --torch VERSION checks against an inventoried torch
that need not be installed: X.Y.Z exactly, X.Y the newest inventoried X.Y.*. Patches count as on or
off the way the TORCHPATCH_* variables of this shell say, whether TORCHPATCH itself is set or not.

Exit status: 0 when no row is unresolved, 1 otherwise, 2 on a usage error or when the helper that
imports torch gives no answer within TORCHPATCH_CHECK_TIMEOUT seconds (default 60). A file that
does not parse is reported and skipped; it does not change the exit status by itself.
"""


def cmd_check(args: argparse.Namespace) -> int:
    from . import _check

    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        print(f"torchpatch check: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        target = _check.choose_target(args.torch, live=not args.no_import)
    except (ValueError, _check.CheckError) as exc:  # no such torch; a bad TORCHPATCH_CHECK_TIMEOUT
        print(f"torchpatch check: {exc}", file=sys.stderr)
        return 2
    try:
        report = _check.check(args.paths, target)
    except _check.CheckError as exc:  # the helper that imports torch did not answer
        print(f"torchpatch check: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else _check.format_text(report))  # one line: the C encoder
    return int(report["exit"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchpatch", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"torchpatch {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    p = sub.add_parser("list", help="every patch: does it apply to the installed torch, is it on, and why")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("doctor", help="environment report: versions, start-up hook, flags, hazards")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser(
        "run",
        help="run CMD with torchpatch on (TORCHPATCH=1), even where the .pth start-up hook is not processed",
        description="Set TORCHPATCH=1 and exec CMD. A bootstrap sitecustomize is put first on PYTHONPATH, so"
        " torchpatch activates even for installs made with --target or on a shared PYTHONPATH; it chains"
        " to any existing sitecustomize.",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser(
        "check",
        help="scan a repository's torch imports (no execution): which resolve on this torch (or --torch X)",
        description=CHECK_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories to scan")
    from ._check import inventory_files

    p.add_argument("--torch", metavar="VERSION",
                   help="check against this torch instead of the installed one: X.Y.Z, or X.Y for the newest"
                   f" inventoried X.Y.*; inventoried: {', '.join(inventory_files())}")
    p.add_argument("--no-import", action="store_true",
                   help="never import the installed torch: names its inventory cannot decide are reported unknown")
    p.add_argument("--json", action="store_true", help="machine-readable output: every row with its locations")
    p.set_defaults(func=cmd_check)
    from ._explain import register as register_explain

    register_explain(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)
