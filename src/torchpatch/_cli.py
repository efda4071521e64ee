"""The ``torchpatch`` command (also ``python -m torchpatch``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional

from _torchpatch_startup import log_is_off

from . import _versions
from ._plan import PatchPlan, plan
from ._version import __version__

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
  TORCHPATCH_REPORT=DIR       each process that activated writes DIR/torchpatch-<host>-<rank>-<pid>.json
                              (as its patches settle, last at exit): its rank, versions, each patch's
                              status (and error), what it used; readable by its owner only
  TORCHPATCH_REPORT_ARGV=0    the report leaves the command line out ("argv": null)

Did it act? A process in which torchpatch activated prints one line when it exits, e.g.
`torchpatch: 0.1.0 on torch 2.4.1, Python 3.11.7: applied ...`; no line means it did not act
(`torchpatch doctor` says why). Output piped into `head` and the like stops quietly (status 141), and
so does Ctrl-C (status 130).
"""


def _plan_rows(plans: List[PatchPlan], activated: bool) -> List[Dict[str, Any]]:
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
            "activated": activated,
            "provides": p.patch.provides,
            "upstream": p.patch.upstream,
        }
        for p in plans
    ]


def cmd_list(args: argparse.Namespace) -> int:
    from ._doctor import activation

    activated, words = activation()
    rows = _plan_rows(plan(), activated)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    torch = _versions.torch_version()
    on, off = ("on", "off") if activated else ("would be on", "would be off")
    intro = "patches:" if activated else "with TORCHPATCH=1 the patches would be:"
    print(f"torchpatch {__version__}, torch {torch or '(not installed)'}; {words}; {intro}")
    width = max([len(r["id"]) for r in rows] + [2])
    for r in rows:
        applies = "applies" if r["applies"] else f"n/a ({r['applies_reason']})"
        state = (on if r["enabled"] else off) + f" ({r['enabled_reason']})"
        tag = " [silent wrong results]" if r["category"] == "correctness" else ""
        print(f"  {r['id']:<{width}}  {applies}; {state}{tag}\n  {'':<{width}}  {r['summary']}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import _doctor

    report = _doctor.report()
    print(json.dumps(report, indent=2) if args.json else _doctor.format_text(report))
    return int(report["exit"])


def cmd_run(args: argparse.Namespace) -> int:
    from . import _run

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return _run.run(command, quiet=log_is_off())


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
(--no-import: never; those names stay unknown); the helper reads a module's source instead of
importing it where the source says plainly (a submodule file, a top-level def, class or assignment). --torch VERSION checks against an inventoried torch
that need not be installed: X.Y.Z exactly, X.Y the newest inventoried X.Y.*. Patches count as on or
off the way the TORCHPATCH_* variables of this shell say, whether TORCHPATCH itself is set or not.

--problems shows only the unresolved, guarded and unknown rows (the counts stay whole). On a
terminal, progress is shown on stderr while the scan and the helper work.

Exit status: 0 when no row is unresolved, 1 otherwise, 2 on a usage error (a missing path, a
directory without .py files, an unknown --torch) or when the helper that
imports torch gives no answer within TORCHPATCH_CHECK_TIMEOUT seconds (default 60). A file that
does not parse, is not a regular file (a FIFO, a device) or is over 10 MB is reported and skipped;
it does not change the exit status by itself.
"""


def cmd_check(args: argparse.Namespace) -> int:
    from . import _check

    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        print(f"torchpatch check: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    empty = [p for p in args.paths if os.path.isdir(p) and next(_check.python_files([p]), None) is None]
    if empty:
        print(f"torchpatch check: no Python files under {', '.join(empty)} (hidden directories, __pycache__,"
              " node_modules, site-packages and virtual environments are skipped): give a repository or .py files",
              file=sys.stderr)
        return 2
    try:
        target = _check.choose_target(args.torch, live=not args.no_import)
    except (ValueError, _check.CheckError) as exc:  # no such torch; a bad TORCHPATCH_CHECK_TIMEOUT
        print(f"torchpatch check: {exc}", file=sys.stderr)
        return 2
    try:
        with _check.Progress(sys.stderr) as progress:  # its line cleared however the check ends (Ctrl-C too)
            report = _check.check(args.paths, target, progress=progress.say)
    except _check.CheckError as exc:  # the helper that imports torch did not answer
        print(f"torchpatch check: {exc}", file=sys.stderr)
        return 2
    if args.problems:
        report = _check.only_problems(report)
    print(json.dumps(report) if args.json else _check.format_text(report))  # one line: the C encoder
    return int(report["exit"])


def build_parser() -> argparse.ArgumentParser:
    from ._doctor import EXIT_CODES

    parser = argparse.ArgumentParser(
        prog="torchpatch", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"torchpatch {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    p = sub.add_parser("list", help="every patch: does it apply to the installed torch, is it (or would it be) on, and why",
                       description="Every patch of the catalogue and the plugins: whether it applies to the installed"
                       " torch and Python, and whether the TORCHPATCH_* variables of this shell have it on. Where"
                       " TORCHPATCH is not set (or off), nothing is applied and the list says what TORCHPATCH=1"
                       " would turn on.")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output: one object per patch ('activated': TORCHPATCH is on here;"
                   " 'active': applies and enabled, so on once activated)")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("doctor", help="environment report: versions, dependencies, start-up hook, copies, flags, hazards",
                       description="What torchpatch finds in this environment, hazards first in capitals, and how"
                       " to tell whether torchpatch acted in a process.\n\n" + EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser(
        "run",
        help="run CMD with torchpatch on (TORCHPATCH=1), even where the .pth start-up hook is not processed",
        description="Set TORCHPATCH=1 and exec CMD. A bootstrap sitecustomize is put first on PYTHONPATH, so"
        " torchpatch activates even for installs made with --target or on a shared PYTHONPATH; it chains"
        " to any existing sitecustomize. Where CMD starts Python with -S (no site: no hook runs at all) or"
        " -I/-E (PYTHONPATH ignored: the bootstrap is not seen), a warning says so (TORCHPATCH_LOG=off: none).",
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
    p.add_argument("--problems", action="store_true", help="show only the unresolved, guarded and unknown rows")
    p.add_argument("--json", action="store_true", help="machine-readable output: every row with its locations")
    p.set_defaults(func=cmd_check)
    from ._check.explain import register as register_explain

    register_explain(sub)
    return parser


def _quietly(run: Callable[[], int]) -> int:
    """``run()``, flushing stdout; where the reader went away (``torchpatch list | head``) or Ctrl-C
    interrupts, exit quietly as the standard tools do (status 141, 128 + SIGPIPE; 130, 128 + SIGINT),
    with no traceback."""
    try:
        try:
            code = run()
        except SystemExit as exc:  # argparse's --help, --version and usage errors
            code = exc.code if isinstance(exc.code, int) else 2
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail again
        os.close(devnull)
        return 141
    except KeyboardInterrupt:
        return 130


def _main(argv: Optional[List[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args))


def main(argv: Optional[List[str]] = None) -> int:
    return _quietly(lambda: _main(argv))
